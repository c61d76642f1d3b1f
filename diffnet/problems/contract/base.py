"""The class every PDE family subclasses, :class:`Problem`: the three parts a problem is made
of, put together, and the one method the engine calls, ``answer``.

* the family (:mod:`.family`, :class:`Family`): the domain and grid, the parameters of a draw,
  its input fields, optionally a reference solver;
* the loss (:mod:`.loss`, :class:`Loss`): the boundary imposition (``impose``) and the
  per-sample loss terms, written with the split-exact helpers so they split over ranks;
* the answer head (:mod:`.heads`, :class:`AnswerHead`), where a problem has one: how the
  answer is formed from the network's imposed fields (``Plain``, the default: the imposed
  field itself; ``Ritz``: the energy's minimiser in their span).

``problem.answer(raw, inputs)`` = ``head.form(impose(raw, inputs), inputs, problem)``: the
network's raw output (B, output_channels, *grid) to the solution field (B, 1, *grid). Training,
validation, inference and export all go through it (``diffnet.answer.Answer``).

``problem.answer_residual(u, inputs)``: how far answers are from the discrete solution, with no
solver: the family's own where it defines one, else derived from the loss
(:mod:`.loss_residual`); :func:`residual_kind` says which.

The engine only ever calls the methods of these parts, so a PDE lives in any importable
module: ``problem.name = "package.module:ClassName"`` or an entry point of group
``diffnet.problems`` finds it (``diffnet.problems.contract.registry``), with no edit of this package;
``deepfusion check-problem`` checks a class against this contract (docs/your-own-pde.md).
"""
from __future__ import annotations

import numpy as np
import torch

from diffnet.domain import Block
from diffnet.problems.contract.family import Family
from diffnet.problems.contract.heads import AnswerHead, Plain
from diffnet.problems.contract.loss import Loss
from diffnet.problems.contract.loss_residual import loss_residual


class Problem(Family, Loss):
    """A parametric PDE family (:class:`Family`), its loss (:class:`Loss`) and its answer head
    (``head``). Subclasses state their equation in the class docstring.

    Class attributes every subclass sets: ``name`` (the registry name, e.g. "burgers"),
    ``param_names``, ``input_channels`` and optionally ``reference_methods``, ... (the
    family's), ``loss_term_names``, ... (the loss's). Besides:

        head: the answer head (default ``Plain()``); a problem whose options choose it sets
            ``self.head`` in ``__init__``.
        output_channels: the fields the network outputs: the head's ``channels``; a problem
            whose own ``impose`` maps several fields to one declares it as a class attribute
            (``output_channels = 2``) and keeps the Plain head.
    """

    head: AnswerHead = Plain()

    def __init__(self, *, grid=(64, 64)):
        super().__init__(grid=grid)
        self.block = Block(self.grid)

    @property
    def output_channels(self) -> int:
        """The fields the network outputs: the answer head's ``channels`` (a subclass's class
        attribute ``output_channels`` takes its place)."""
        return self.head.channels

    def answer(self, raw: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """(B, 1, *grid) the answer to the input fields ``inputs`` (B, C, *grid) from the
        network's raw output (B, output_channels, *grid): the boundary values imposed on each
        field (``impose``), then the answer head. On a split block, this block's part."""
        return self.head.form(self.impose(raw, inputs), inputs, self)

    def answer_residual(self, u, inputs) -> np.ndarray:
        """(B,) float64: how far answers u (B, 1, *grid) are from the discrete solution of
        inputs (B, C, *grid) (numpy or torch, the whole grid): 0 there, 1 at the boundary
        lift. This default derives it from the loss (:func:`.loss_residual.loss_residual`:
        the loss's gradient at the free nodes, in the multilevel norm, over the lift's); a
        family that defines its own overrides it."""
        return loss_residual(self, u, inputs)


RESIDUAL_KINDS = ("family", "loss")


def residual_kind(problem) -> str:
    """Which answer residual ``problem`` (a class or an instance) has: "family" (it defines its
    own ``answer_residual``) or "loss" (the one derived from its loss). A threshold calibrated
    for one is not one for the other."""
    cls = problem if isinstance(problem, type) else type(problem)
    return "loss" if cls.answer_residual is Problem.answer_residual else "family"
