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

The engine only ever calls the methods of these parts, so a PDE lives in any importable
module: ``problem.name = "package.module:ClassName"`` or an entry point of group
``diffnet.problems`` finds it (``diffnet.problems.contract.registry``), with no edit of this package;
``deepfusion check-problem`` checks a class against this contract (docs/your-own-pde.md).
"""
from __future__ import annotations

import torch

from diffnet.domain import Block
from diffnet.problems.contract.family import Family
from diffnet.problems.contract.heads import AnswerHead, Plain
from diffnet.problems.contract.loss import Loss


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
