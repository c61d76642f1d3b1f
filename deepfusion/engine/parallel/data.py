"""The sample pool and its deterministic split over ranks.

The pool holds N_s parameter draws; sample i depends only on (seed, i), and so do its input
bits (:class:`InputCache` builds each sample alone). Every epoch orders the pool by a
permutation that depends only on (seed, epoch), and global step s takes the next b_s samples
of that order; rank r takes the r-th contiguous block of b_s / P of them. So each global
step sees the same set of samples whatever P is ("same problem is solved for any p"). Under a
domain split the units are the groups of ranks that share samples, not the ranks.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def check_divisible(global_batch: int, size: int) -> int:
    """Local batch b_s / P, or a ValueError naming both numbers and the nearest valid choices
    of either (a batch for this P, or a P for this batch: what an elastic resume can change)."""
    if global_batch % size == 0:
        return global_batch // size
    lo = (global_batch // size) * size
    batches = " or ".join(str(c) for c in (lo, lo + size) if c > 0)
    ranks = " or ".join(str(p) for p in nearest_divisors(global_batch, size))
    raise ValueError(
        f"data.global_batch = {global_batch} is not divisible by the number of ranks P = {size}; "
        f"every rank needs an equal local batch. Run on P = {ranks} ranks, or use "
        f"data.global_batch = {batches} (a new run: a resumed run keeps its batch).")


def nearest_divisors(n: int, p: int) -> list[int]:
    """The divisors of ``n`` closest to ``p`` from below and above (one or two of them)."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    below = [d for d in divisors if d < p]
    above = [d for d in divisors if d > p]
    return ([below[-1]] if below else []) + ([above[0]] if above else [])


class ShardedPool:
    """Which pool indices rank ``rank`` of ``size`` processes at each (epoch, step)."""

    def __init__(self, n_samples: int, global_batch: int, rank: int, size: int, *, seed: int,
                 shuffle: bool = True):
        if not 1 <= global_batch <= n_samples:
            raise ValueError(f"data.global_batch = {global_batch} must be in [1, data.n_samples = "
                             f"{n_samples}]")
        self.local_batch = check_divisible(global_batch, size)
        self.n_samples, self.global_batch = n_samples, global_batch
        self.rank, self.size, self.seed, self.shuffle = rank, size, seed, shuffle
        # Drop the last incomplete global batch: equal batches on all ranks and every step alike.
        self.steps_per_epoch = n_samples // global_batch
        self._order_epoch, self._order = None, None

    def order(self, epoch: int) -> np.ndarray:
        """The pool order of ``epoch``, computed once per epoch (every step of it asks)."""
        if self._order_epoch != epoch:
            self._order = (np.random.default_rng([self.seed, 7919, epoch]).permutation(self.n_samples)
                           if self.shuffle else np.arange(self.n_samples))
            self._order_epoch = epoch
        return self._order

    def global_indices(self, epoch: int, step_in_epoch: int) -> np.ndarray:
        start = step_in_epoch * self.global_batch
        return self.order(epoch)[start:start + self.global_batch]

    def local_indices(self, epoch: int, step_in_epoch: int) -> np.ndarray:
        g = self.global_indices(epoch, step_in_epoch)
        lo = self.rank * self.local_batch
        out = g[lo:lo + self.local_batch]
        assert len(out) == self.local_batch
        return out


class InputCache:
    """Builds network inputs for pool indices, caching them while the pool fits a memory cap.

    Every sample is built on its own (one ``build_input`` call per sample), so its bits never
    depend on which samples it was first built with: a problem's batched arithmetic (e.g. a
    BLAS product over the batch) may round a row differently for another batch size, and
    which samples miss the cache together depends on the ranks and on where a run resumed.
    Built alone, a resumed run (empty cache) rebuilds exactly the inputs the uninterrupted run
    cached. Under a domain split (``block``) the sample is built on the whole grid, as the
    undivided run builds it, and only this rank's block of it is kept."""

    def __init__(self, problem, seed: int, dtype, cap_bytes: float = 2 * 2**30, block=None):
        self.problem, self.seed, self.dtype, self.block = problem, seed, dtype, block
        self.cap_bytes, self.used, self.cache = cap_bytes, 0, {}

    def build(self, i: int):
        """The inputs (C, *grid) of pool sample ``i`` (its block, under a split), built alone."""
        params = self.problem.sample_params(self.seed, [i])
        x = self.problem.build_input(params, dtype=self.dtype)[0]
        if self.block is None or self.block.whole:
            return x
        return self.block.local(x).contiguous()

    def __call__(self, indices):
        import torch

        missing = [int(i) for i in indices if int(i) not in self.cache]
        if missing:
            built = [self.build(i) for i in missing]
            for i, x in zip(missing, built):
                if self.used + x.numel() * x.element_size() <= self.cap_bytes:
                    self.cache[i] = x
                    self.used += x.numel() * x.element_size()
            fresh = dict(zip(missing, built))
        else:
            fresh = {}
        return torch.stack([self.cache[int(i)] if int(i) in self.cache else fresh[int(i)]
                            for i in indices])


class LazyBatch:
    """A local batch whose inputs are built per micro-batch, on demand, by ``build(indices)``
    (an :class:`InputCache`): ``len(batch)`` samples, ``micro_batch`` per chunk. A step that
    evaluates the loss many times (L-BFGS's line search) never holds all inputs at once."""

    def __init__(self, build, indices, micro_batch: int):
        self.build, self.indices = build, list(indices)
        self.micro_batch = max(1, int(micro_batch)) if micro_batch > 0 else len(self.indices)

    def __len__(self):
        return len(self.indices)

    def materialize(self):
        """All inputs at once, (B, C, *grid)."""
        return self.build(self.indices)

    def chunks(self) -> "LazyChunks":
        return LazyChunks(self)


class LazyChunks(Sequence):
    """The micro-batches of a :class:`LazyBatch`, each built when indexed."""

    def __init__(self, batch: LazyBatch):
        self.b = batch

    def __len__(self):
        n, m = len(self.b.indices), self.b.micro_batch
        return (n + m - 1) // m

    def __getitem__(self, k):
        if not 0 <= k < len(self):
            raise IndexError(k)
        m = self.b.micro_batch
        return self.b.build(self.b.indices[k * m:(k + 1) * m])


def group_count(ranks: int, split, setting: str = "") -> int:
    """How many domain groups of D = prod(split) ranks a job of ``ranks`` ranks makes.

    The one check that the job size fits the split (the training config, ``infer --domain``
    and ``halo.domain_groups`` all call it; here, torch-free, so a launch is checked before
    torch is imported); ValueError naming ``setting`` (what gave the split,
    default ``parallel.domain = [...]``), the rank counts that work and the splits that fit.
    """
    setting = setting or f"parallel.domain = {list(split)}"
    if any(int(s) < 1 for s in split):
        raise ValueError(f"{setting} must count blocks, 1 or more per axis")
    d = math.prod(int(s) for s in split)
    if ranks % d:
        ok = sorted({max(d, ranks // d * d), -(-ranks // d) * d})
        fits = [k for k in range(1, ranks + 1) if ranks % k == 0]
        raise ValueError(f"{setting} puts {d} ranks on every sample, but the job has {ranks} "
                         f"ranks, not a multiple of {d}: run on {' or '.join(map(str, ok))} "
                         f"ranks, or choose a split with {fits} blocks in all")
    return ranks // d
