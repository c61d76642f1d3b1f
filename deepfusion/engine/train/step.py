"""One global loss-and-gradient evaluation, data-parallel.

``LossAndGrad.__call__(x)`` is what both Adam's step and L-BFGS's closure call:
  1. zero the flat gradient buckets;
  2. for each micro-batch of the local batch: forward, per-sample loss terms, backward of
     (local sum / global batch) -- so gradients accumulate the local share of the global mean;
  3. reduce the gradient buckets (SUM over ranks -> the global-mean gradient on every rank);
  4. one fused allreduce of [loss-term sums..., non-finite counts..., flags...], so every rank
     sees the global loss and takes the same branch on "is it finite?" and "stop requested?";
     with ``allreduce_stats`` every rank's durations of step 3 ride in it too (4 numbers per
     rank: :mod:`~deepfusion.engine.parallel.commstats`), and the result carries the gradient
     all-reduce's wait, move and exposed seconds per rank (``StepResult.comm``).

The problem is any object with ``answer(y, x)`` (the network's output y to the answer field)
and ``loss_terms(u, x) -> {name: (B,)}``; the engine knows nothing of the PDE behind it. The
model is a :class:`~deepfusion.engine.parallel.parallelize.ParallelModel`: how the gradients are summed is
its business.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from deepfusion.engine.parallel import commstats
from deepfusion.engine.parallel.data import LazyBatch
from deepfusion.engine.parallel.memformat import as_format
from deepfusion.engine.parallel.parallelize import ParallelModel

# Per-rank requests reduced (summed) with the loss, so every rank sees them at the same step:
# "stop" (SIGTERM/SIGUSR1 on some rank), "checkpoint" (rank 0's clock says one is due),
# "time_limit" (rank 0's clock says train.time_limit_minutes have passed).
FLAGS = ("stop", "checkpoint", "time_limit")


@dataclass
class StepResult:
    """The global quantities of one evaluation (identical on every rank)."""

    loss: float
    terms: dict[str, float]
    nonfinite_terms: list[str]
    grad_norm: float
    flags: dict[str, float]
    times: dict[str, float] = field(default_factory=dict)
    lr: float = float("nan")                        # the learning rate the step was taken with
    metrics: dict = field(default_factory=dict)     # optimiser-specific extras (L-BFGS counts)
    comm: dict = field(default_factory=dict)        # the gradient all-reduce per rank (commstats)

    @property
    def finite(self) -> bool:
        return not self.nonfinite_terms and self.grad_norm == self.grad_norm \
            and self.grad_norm != float("inf")


class LossAndGrad:
    """Global mean loss and gradient over the global batch for a parallel model."""

    def __init__(self, model: ParallelModel, problem, *, global_batch: int,
                 term_names: tuple[str, ...], micro_batch: int = 0, channels_last: bool = True,
                 precision: str = "fp32", allreduce_stats: bool = False):
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be 'fp32' or 'bf16', got {precision!r}")
        self.model, self.problem, self.comm, self.gs = model, problem, model.comm, model.grads
        self.global_batch, self.term_names = global_batch, tuple(term_names)
        self.micro_batch, self.channels_last = micro_batch, channels_last
        self.precision = precision
        self.flags = {k: 0.0 for k in FLAGS}
        # Each rank's gradient all-reduce durations, in its own slots of the fused buffer (a
        # sum over ranks of one non-zero each is exact); none on one rank (nothing reduced).
        self.stats = allreduce_stats and self.comm.size > 1
        # [term sums | non-finite counts per term | flags | per-rank durations] in one float64
        # buffer, one allreduce.
        self._head = 2 * len(self.term_names) + len(FLAGS)
        per_rank = len(commstats.FIELDS) * self.comm.size if self.stats else 0
        self._buf = torch.zeros(self._head + per_rank, dtype=torch.float64)

    def forward_terms(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-sample loss terms of the model's prediction for inputs x (B, C, *grid): (B, C,
        H, W) or (B, C, D, H, W), channels-last of its rank with ``channels_last``."""
        if self.channels_last:
            x = as_format(x)
        if self.precision == "bf16":  # the network in bf16 (autocast); the PDE loss in fp32
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = self.model.forward(x)
            y = y.float()
        else:
            y = self.model.forward(x)
        u = self.problem.answer(y, x)
        terms = self.problem.loss_terms(u, x)
        assert set(terms) == set(self.term_names), \
            f"problem returned loss terms {sorted(terms)}, expected {sorted(self.term_names)}"
        return terms

    def __call__(self, x) -> StepResult:
        """``x``: the local batch, a tensor (B, C, *grid) or a :class:`LazyBatch`."""
        t_fwd = t_bwd = 0.0
        self.gs.zero_()
        sums = torch.zeros(len(self.term_names), dtype=torch.float64)
        chunks = self._chunks(x)
        for k, xb in enumerate(chunks):
            self.gs.accumulate_only(k < len(chunks) - 1)  # overlap launches on the last one only
            t0 = time.perf_counter()
            terms = self.forward_terms(xb)
            per_sample = [terms[n] for n in self.term_names]
            local = torch.stack([t.sum() for t in per_sample])
            total = local.sum() / self.global_batch
            t1 = time.perf_counter()
            total.backward()
            t2 = time.perf_counter()
            sums += local.detach().double()
            t_fwd, t_bwd = t_fwd + (t1 - t0), t_bwd + (t2 - t1)
        self.gs.backward_done()
        self.gs.accumulate_only(False)
        self.gs.reduce()
        t_ar = self.gs.seconds
        t3 = time.perf_counter()
        result = self._fused_reduce(sums)
        t_ar += time.perf_counter() - t3
        result.times = {"forward": t_fwd, "backward": t_bwd, "allreduce": t_ar}
        return result

    def _chunks(self, x):
        if isinstance(x, LazyBatch):  # inputs built per micro-batch, at every evaluation
            return x.chunks()
        if self.micro_batch <= 0 or self.micro_batch >= x.shape[0]:
            return [x]
        return list(torch.split(x, self.micro_batch))

    def _fused_reduce(self, sums: torch.Tensor) -> StepResult:
        n = len(self.term_names)
        buf = self._buf
        nonfinite = ~torch.isfinite(sums)
        buf[:n] = torch.where(nonfinite, torch.zeros_like(sums), sums)
        buf[n:2 * n] = nonfinite.double()
        buf[2 * n:self._head] = torch.tensor([self.flags[k] for k in FLAGS], dtype=torch.float64)
        if self.stats:
            k, r = len(commstats.FIELDS), self.comm.rank
            buf[self._head:] = 0.0
            buf[self._head + k * r:self._head + k * (r + 1)] = torch.tensor(
                self.gs.times.row(), dtype=torch.float64)
        self.comm.allreduce_(buf)
        self.gs.synced()
        terms = {name: float(buf[i]) / self.global_batch for i, name in enumerate(self.term_names)}
        bad = [name for i, name in enumerate(self.term_names) if buf[n + i] > 0]
        flags = {k: float(buf[2 * n + i]) for i, k in enumerate(FLAGS)}
        loss = float("nan") if bad else sum(terms.values())
        comm = {}
        if self.stats:
            comm = commstats.attribute(buf[self._head:].view(self.comm.size, -1).tolist(),
                                       nbytes=self.gs.nbytes, overlap=self.gs.overlap)
        # The reduced gradient is bit-identical on all ranks, so its norm (and finiteness) is too.
        return StepResult(loss, terms, bad, self.gs.grad_norm(), flags, comm=comm)
