"""Gradient synchronisation: parameters' .grad live in contiguous flat buckets, summed in place.

Every parameter's ``.grad`` is a view into one flat buffer per bucket, so autograd accumulates
straight into the buffers that MPI reduces: no packing, no copies between torch and MPI (the
buffer reaches MPI as a numpy view). The loss a rank back-propagates is its local *sum*
divided by the *global* batch size, so a SUM-allreduce yields the global mean gradient with no
extra pass.

With ``overlap=True`` a post-accumulate-grad hook counts each bucket's ready parameters and
starts a non-blocking allreduce as soon as a bucket is complete, while backward continues (as
DDP and Horovod do). Buckets are launched strictly in index order on every rank: MPI requires
collectives in the same order everywhere, and readiness order is not something to rely on.

MPICH (and Open MPI by default) make no asynchronous progress: a started allreduce moves only
inside MPI calls, so without them it would all happen in the final ``wait``. With ``poll`` (the
default) every hook also tests the oldest unfinished request, which drives MPI's progress
engine from the backward pass (``python -m bench.comm_bench``, ``overlap`` lines: steps with
overlap and polling, overlap without polling, and no overlap).

Every reduction leaves this rank's durations in ``times``: from the end of backward
(:meth:`GradSync.backward_done`) to the reduction, blocked in it, and in the backward hooks; how
they separate waiting for the other ranks from moving the bytes:
:mod:`deepfusion.engine.parallel.commstats`.
"""
from __future__ import annotations

import time

import torch

from deepfusion.engine.parallel.comm import Communicator
from deepfusion.engine.parallel.commstats import ReduceTimes
from deepfusion.engine.parallel.memformat import is_dense


class GradSync:
    """Owns the flat gradient buckets of ``model`` and reduces them over ``comm``."""

    def __init__(self, model: torch.nn.Module, comm: Communicator, *, bucket_mb: float = 4.0,
                 overlap: bool = False, poll: bool = True):
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        self.comm, self.overlap = comm, overlap and comm.size > 1
        self.poll = poll  # with overlap: test the oldest unfinished request in every hook
        self._done = 0    # buckets [0, _done) are known to be reduced in this step
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = self._make_buckets(self.params, bucket_mb)
        self.seconds = 0.0  # time blocked in communication during the last reduce
        self.times = ReduceTimes()  # this rank's durations of the last reduce (commstats)
        self.nbytes = sum(b["flat"].numel() * b["flat"].element_size() for b in self.buckets)
        self._t_ready = None    # when backward ended (backward_done), for times.enter
        self._t_sync = None     # when the ranks last left a reduction together, times.arrive
        self._progress = 0.0    # seconds in the overlap hooks since the step's zero_
        self._hooks = []
        self._enabled = True
        if self.overlap:
            self._install_hooks()
        self.zero_()

    # -- buffers ------------------------------------------------------------------------------
    @staticmethod
    def _make_buckets(params, bucket_mb):
        """Group parameters (reverse order ~ backward order) into flat buffers of ~bucket_mb."""
        cap = int(bucket_mb * 2**20)
        groups, cur, size = [], [], 0
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            if cur and size + nbytes > cap:
                groups.append(cur)
                cur, size = [], 0
            cur.append(p)
            size += nbytes
        if cur:
            groups.append(cur)
        buckets = []
        for group in groups:
            dtype = group[0].dtype
            assert all(p.dtype == dtype for p in group), "one dtype per bucket"
            flat = torch.zeros(sum(p.numel() for p in group), dtype=dtype)
            off = 0
            for p in group:
                # A view with the parameter's own strides (channels_last / channels_last_3d
                # weights included), so autograd accumulates into it in place and the grad
                # layout contract holds.
                p.grad = flat.as_strided(p.shape, p.stride(), off) if is_dense(p) \
                    else flat[off:off + p.numel()].view(p.shape)
                off += p.numel()
            buckets.append({"flat": flat, "params": group, "ready": 0, "req": None})
        return buckets

    def flat_grads(self) -> list[torch.Tensor]:
        return [b["flat"] for b in self.buckets]

    def zero_(self):
        """Zero all gradient buffers (never set them to None: the views must survive)."""
        for b in self.buckets:
            b["flat"].zero_()
            b["ready"], b["req"] = 0, None
        self._next = 0
        self._t_ready, self._progress = None, 0.0

    def check_views(self):
        """Invariant: every .grad is still a view into its bucket (an optimiser's
        zero_grad(set_to_none=True) or a replaced .grad would silently break reduction)."""
        for b in self.buckets:
            lo = b["flat"].data_ptr()
            hi = lo + b["flat"].numel() * b["flat"].element_size()
            for p in b["params"]:
                assert p.grad is not None and lo <= p.grad.data_ptr() < hi, \
                    "a parameter's .grad no longer points into its gradient bucket"

    # -- overlap ------------------------------------------------------------------------------
    def _install_hooks(self):
        owner = {}
        for i, b in enumerate(self.buckets):
            for p in b["params"]:
                owner[p] = i
        for p in self.params:
            self._hooks.append(p.register_post_accumulate_grad_hook(
                lambda param, i=owner[p]: self._on_ready(i)))

    def close(self):
        """Detach from the parameters (remove the overlap hooks), so the same parameters can
        join the buckets of another GradSync (a grown model is parallelised anew). Their
        ``.grad`` views go too: a parameter the next GradSync leaves out (frozen) must not
        keep its last gradient, which an optimiser would go on applying."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._enabled = False
        for p in self.params:
            p.grad = None

    def _on_ready(self, i):
        if not self._enabled:
            return
        t0 = time.perf_counter()
        b = self.buckets[i]
        b["ready"] += 1
        # Launch every complete bucket in index order, so all ranks issue the same sequence.
        while self._next < len(self.buckets) and \
                self.buckets[self._next]["ready"] == len(self.buckets[self._next]["params"]):
            nb = self.buckets[self._next]
            nb["req"] = self.comm.iallreduce_(nb["flat"])
            self._next += 1
        # Drive MPI's progress engine from the backward pass (it makes none of its own).
        while self.poll and self._done < self._next and self.buckets[self._done]["req"].Test():
            self._done += 1
        self._progress += time.perf_counter() - t0

    def accumulate_only(self, flag: bool):
        """While True, backward passes only accumulate (micro-batches before the last one)."""
        self._enabled = not flag

    # -- reduce -------------------------------------------------------------------------------
    def backward_done(self):
        """Mark the end of this step's backward pass: the time to enter the reduction
        (``times.enter``) runs from here to :meth:`reduce`."""
        self._t_ready = time.perf_counter()

    def synced(self):
        """Mark a moment every rank leaves together (the step's loss reduction): the next
        reduction's ``times.arrive`` runs from here, so the ranks' arrivals compare."""
        self._t_sync = time.perf_counter()

    def reduce(self):
        """Complete the global gradient sum on every rank; records blocked seconds and this
        rank's durations (``times``)."""
        t0 = time.perf_counter()
        first = None
        if self.comm.size > 1:
            if self.overlap:
                for b in self.buckets[self._next:]:  # buckets whose params got no gradient
                    b["req"] = self.comm.iallreduce_(b["flat"])
                self._next = len(self.buckets)
                for b in self.buckets:
                    b["req"].wait()
                    b["req"], b["ready"] = None, 0
                self._next = self._done = 0
            else:
                for b in self.buckets:
                    self.comm.allreduce_(b["flat"])
                    if first is None:  # the arrival skew lands in the first (commstats)
                        first = time.perf_counter() - t0
        self.seconds = time.perf_counter() - t0
        enter = t0 - self._t_ready if self._t_ready is not None else 0.0
        arrive = t0 - self._t_sync if self._t_sync is not None else 0.0
        self.times = ReduceTimes(enter=enter, first=self.seconds if first is None else first,
                                 inside=self.seconds, progress=self._progress, arrive=arrive)
        self._t_ready, self._progress = None, 0.0

    def grad_norm(self) -> float:
        """L2 norm of the (already reduced, hence rank-identical) gradient."""
        sq = sum(float(torch.dot(b["flat"], b["flat"])) for b in self.buckets)
        return sq ** 0.5

    def clip_(self, max_norm: float, norm: float):
        if max_norm > 0 and norm > max_norm:
            for b in self.buckets:
                b["flat"].mul_(max_norm / (norm + 1e-12))
