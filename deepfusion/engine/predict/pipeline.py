"""The one prediction pipeline, built by the prediction service (:mod:`.service`): in-training
validation and ``deepfusion evaluate`` (:mod:`.evaluate`), ``deepfusion infer``, the Python API
(``deepfusion.load``) and ``deepfusion export`` all predict through :class:`Pipeline`.

One batch at a time::

    samples[lo:hi] -> inputs on the work grid (parameter draws rendered there, given fields
    resampled), under a domain split only this rank's block of them (draws rendered at the
    block's nodes alone: Problem.build_block_input) -> memory format -> the answer
    (diffnet.answer.Answer: network, boundary imposition, answer head) -> the coarse
    correction, if asked (diffnet.problems.coarse_correction, whole grid only) -> post-step (extra
    per-sample outputs, on the block) -> the whole field on the group's first rank ->
    interpolated to the output grid

Without a domain split and from given fields, that is :class:`AnswerOnGrid`, one torch module
(the pipeline holds one and runs its steps): what ``deepfusion export`` writes to a file and
``Solver.module`` is.

The work grid is the grid the network runs on; without one it is the output grid and both
resampling steps are no-ops, so validation on the training grid computes exactly what it
always did. A domain split goes through :func:`split_for_prediction`, which uses the same
``make_domain`` and ``split_generator`` as training's ``parallelize``.

The pipeline sets no autograd mode: validation runs it under ``torch.no_grad`` (training
continues on the same problem objects afterwards, so nothing may become an inference tensor),
``infer`` and the Python API under ``torch.inference_mode``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from diffnet.answer import Answer
from diffnet.problems import coarse_correction
from diffnet.resample import resample_nodes
from diffnet.split_layers import check_generator_split, split_generator

from deepfusion.engine.parallel.data import group_count
from deepfusion.engine.parallel.memformat import as_format
from deepfusion.engine.parallel.parallelize import Domain, make_domain


@dataclass
class Samples:
    """N samples: parameter vectors (N, k) (k = 0 for given fields) and/or fields (N, C, *grid)
    (a numpy array or a torch tensor)."""

    params: np.ndarray
    fields: object = None

    @property
    def n(self) -> int:
        return len(self.params)

    @property
    def rendered(self) -> bool:
        """Whether the inputs are rendered from parameters (on any grid) rather than given."""
        return self.fields is None

    def inputs(self, problem, lo: int, hi: int, dtype=torch.float32) -> torch.Tensor:
        """Samples [lo, hi) as network inputs: the given fields, or the draws rendered on
        ``problem``'s grid."""
        if self.fields is not None:
            return torch.as_tensor(self.fields[lo:hi], dtype=dtype)
        return problem.build_input(self.params[lo:hi], dtype=dtype)

    def on_grid(self, problem, lo: int, hi: int, dtype=torch.float32) -> torch.Tensor:
        """Samples [lo, hi) on ``problem``'s grid: draws rendered there, as in training
        (resampling a fine rendering would blur jumps in a high-contrast coefficient); given
        fields resampled (bilinear / trilinear on the nodes)."""
        return resample_nodes(self.inputs(problem, lo, hi, dtype), problem.grid)

    def on_block(self, problem, block, lo: int, hi: int, dtype=torch.float32) -> torch.Tensor:
        """Samples [lo, hi) on ``block`` of ``problem``'s grid: draws rendered at the block's
        nodes alone (``build_block_input``: the block of :meth:`on_grid`'s field bit for
        bit); given fields resampled to the whole grid, then cut."""
        if self.rendered:
            return problem.build_block_input(self.params[lo:hi], block, dtype=dtype)
        return block.local(self.on_grid(problem, lo, hi, dtype)).contiguous()


@dataclass
class Batch:
    """One batch's result, samples [lo, hi). ``u`` (b, *grid) on the output grid and ``inputs``
    (b, C, *grid) there (when kept) on the group's first rank, None on the others (tensors, or
    arrays once made ready for a file: :func:`~deepfusion.engine.predict.service.as_arrays`);
    ``extra``: per-sample outputs {name: (b,)}, of the post-step (every rank of a group gets
    them) or records of the answers (refinement, check); ``seconds``: the time of the answer."""

    u: object
    inputs: object
    extra: dict = field(default_factory=dict)
    lo: int = 0
    hi: int = 0
    seconds: float = 0.0


class AnswerOnGrid(torch.nn.Module):
    """Input fields (B, C, *grid) on ``problem``'s grid -> the answer (B, 1, *grid) there:
    resampled to the work problem's grid (``work``; None: ``problem``'s own), in the memory
    format, the answer (network, imposition, answer head) there, resampled back. The
    pipeline's per-batch computation without ranks, from given fields."""

    def __init__(self, model, problem, work=None, channels_last: bool = False):
        super().__init__()
        self.answer = Answer(model, work or problem)
        self.grid, self.work_grid = tuple(problem.grid), tuple((work or problem).grid)
        self.channels_last = bool(channels_last)

    def formatted(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` in the memory format the network takes."""
        return as_format(x, self.channels_last)

    def output(self, u: torch.Tensor) -> torch.Tensor:
        """The answer ``u`` on the work grid, interpolated to the output grid."""
        return resample_nodes(u, self.grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.answer(self.formatted(resample_nodes(x, self.work_grid))))


class Pipeline:
    """Predictions of ``model`` for ``problem`` (the output grid).

    ``work``: the same problem on the grid the network runs on (None: the output grid);
    under a domain split (``domain``) the model and the work problem (or ``problem``) are
    already on this rank's block (:func:`split_for_prediction`). ``post(u, x) -> {name:
    (b,) array}``: a per-batch post-step on the answer ``u`` (b, 1, *block) and the network
    input ``x`` on the work grid's block (e.g. loss terms, a residual check); collective
    within a group if it sums over the blocks. ``correction``: the cells per axis of the
    coarse correction of every answer (0: none; ValueError with a domain split, whose answers
    are not whole on one rank).
    """

    def __init__(self, model, problem, *, work=None, channels_last: bool = False,
                 domain: Domain | None = None, dtype=None, post: Callable | None = None,
                 correction: int = 0):
        if correction and domain is not None:
            raise ValueError(f"the coarse correction ({correction} cells) needs each answer "
                             f"whole on one rank; a domain split's answers are not: answer "
                             f"without it (correction 0) or without the split")
        self.correction = int(correction)
        self.problem = problem
        self.on = work or problem
        self.module = AnswerOnGrid(model, problem, work, channels_last)
        self.answer = self.module.answer
        self.domain = domain
        self.dtype = dtype or next(model.parameters()).dtype
        self.post = post

    @property
    def lead(self) -> bool:
        """Whether this rank holds the whole answers (no split, or the group's first rank)."""
        return self.domain is None or self.domain.comm.rank == 0

    def __call__(self, samples: Samples, lo: int, hi: int, *, keep_inputs: bool = True) -> Batch:
        """Samples [lo, hi): every rank of a group calls it with the same batch."""
        x = self.record(samples, lo, hi) if keep_inputs else None
        return self.answer_batch(samples, lo, hi, x)

    def record(self, samples: Samples, lo: int, hi: int) -> torch.Tensor | None:
        """The inputs of samples [lo, hi) on the output grid, as a fields file records them;
        None off the group's first rank (which never needs them). Collective within a group:
        its other ranks wait here, not inside the timed answer."""
        x = samples.inputs(self.problem, lo, hi, self.dtype) if self.lead else None
        if self.domain is not None:
            self.domain.comm.barrier()
        return x

    def answer_batch(self, samples: Samples, lo: int, hi: int, x=None) -> Batch:
        """Samples [lo, hi) through the network; ``x``: their :meth:`record`, if made (reused
        when it already is the network's input)."""
        xin = self.module.formatted(self.network_input(samples, lo, hi, x))
        u = self.answer(xin)
        if self.correction:
            u = coarse_correction(self.on, u, xin, self.correction)
        # the post-step: per-sample outputs computed from the answer on this rank's block
        extra = self.post(u, xin) if self.post is not None else {}
        del xin
        if self.domain is not None:
            u = self.gather(u)
            if u is None:
                return Batch(None, None, extra, lo, hi)
        return Batch(self.module.output(u)[:, 0], x, extra, lo, hi)

    def network_input(self, samples: Samples, lo: int, hi: int, x=None) -> torch.Tensor:
        """Samples [lo, hi) on the work grid, this rank's block of it under a split: the
        recorded ``x`` when it already is that input, else drawn anew (on a split, at the
        block's nodes alone: no rank builds a whole field it does not keep)."""
        reuse = x is not None and (self.on is self.problem or not samples.rendered)
        if self.domain is None:
            if reuse:
                return resample_nodes(x, self.on.grid)
            return samples.on_grid(self.on, lo, hi, self.dtype)
        if reuse:   # the group's first rank, which keeps x for the file anyway: cut it
            return self.domain.block.local(resample_nodes(x, self.on.grid)).contiguous()
        return samples.on_block(self.on, self.domain.block, lo, hi, self.dtype)

    def gather(self, u: torch.Tensor) -> torch.Tensor | None:
        """The whole answers (b, 1, *grid) from every rank's block, on the group's first rank
        (None elsewhere)."""
        whole = assemble(u[:, 0].double().numpy(), self.domain)   # double: bf16 has no numpy
        return None if whole is None else torch.as_tensor(whole, dtype=u.dtype)[:, None]


def assemble(pieces: np.ndarray, domain: Domain) -> np.ndarray | None:
    """The whole fields (n, *grid) from every rank's block (n, *block.shape), on the group's
    first rank (None elsewhere). Collective within the group."""
    b = domain.block
    if pieces.ndim == 1:  # the group got no draws (more groups than draws): all its ranks alike
        return np.zeros((0, *b.grid)) if domain.comm.rank == 0 else None
    parts = domain.comm.gather_obj((b.start, b.shape, pieces))
    if parts is None:
        return None
    whole = np.empty((pieces.shape[0], *b.grid), dtype=pieces.dtype)
    for start, shape, piece in parts:
        whole[(slice(None), *(slice(s, s + k) for s, k in zip(start, shape)))] = piece
    return whole


def split_for_prediction(comm, split, model, problem, setting: str = "") -> Domain | None:
    """The domain split ``split`` (blocks per axis) of ``problem``'s grid over ``comm``'s
    ranks, as training's ``parallelize`` applies it (``make_domain``, ``split_generator``):
    ``model`` and ``problem`` set to compute on this rank's block (in place). None when
    prod(split) is 1. ``setting`` names what gave the split in the messages. The checks
    (:func:`check_split`) are the caller's, under its error policy."""
    domain = make_domain(comm, split, problem.grid)
    if domain is not None:
        split_generator(model, domain.block)
        problem.on_block(domain.block)
    return domain


def check_split(ranks: int, split, model, grid, setting: str) -> None:
    """ValueError unless ``model`` splits into ``split`` blocks of ``grid`` and ``ranks``
    ranks form whole groups of prod(split)."""
    check_generator_split(model, grid, split)
    group_count(ranks, split, setting)
