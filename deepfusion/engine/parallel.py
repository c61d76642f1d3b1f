"""The one place that makes a built model parallel: :func:`parallelize`.

As in torchtitan, parallelism is applied to an already built model by one function; the trainer
receives the result and does not know how it is parallel. Today that is data parallelism:

1. broadcast rank 0's parameters and buffers, so every rank starts equal;
2. gradient synchronisation: every ``.grad`` becomes a view into flat buckets that are summed
   over the ranks in place (:class:`~deepfusion.engine.gradsync.GradSync`, with optional
   overlap of the allreduce with backward);
3. optionally ``torch.compile`` of the forward (same parameters, so gradients still land in
   the buckets).

A domain split (one field over several ranks) will be applied here too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .comm import Communicator
from .gradsync import GradSync


@dataclass
class ParallelModel:
    """A model made parallel: what the step and the trainer use instead of the bare module."""

    module: torch.nn.Module            # the model as built: its state_dict is what is saved
    forward: Callable                  # what runs it: the module or its compiled wrapper
    comm: Communicator                 # the ranks whose gradients are summed
    grads: GradSync                    # the flat gradient buckets
    cfg: object = None                 # the [parallel] section applied
    compiled: bool = False

    def rewrap(self, module: torch.nn.Module) -> "ParallelModel":
        """The same parallelism applied to another module (a grown one that contains this
        one's): this one's gradient buckets let go of the parameters first."""
        self.grads.close()
        return parallelize(module, self.comm, self.cfg, compile=self.compiled)

    def parameters(self):
        return self.module.parameters()

    def checksum(self) -> tuple[float, float]:
        """(max, min) over ranks of a checksum of the parameters: equal iff in sync."""
        return parameter_checksum(self.module, self.comm)


def parallelize(model: torch.nn.Module, comm: Communicator, cfg, *,
                compile: bool = False) -> ParallelModel:
    """Apply the parallelism of ``cfg`` (a ``[parallel]`` section) to a built ``model``."""
    broadcast_module(model, comm)
    grads = GradSync(model, comm, bucket_mb=cfg.bucket_mb, overlap=cfg.overlap)
    forward = torch.compile(model, dynamic=False) if compile else model
    return ParallelModel(model, forward, comm, grads, cfg, compile)


def broadcast_module(module: torch.nn.Module, comm: Communicator, root: int = 0):
    """Make every rank's parameters and buffers equal to ``root``'s (in place)."""
    if comm.size == 1:
        return
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            if t.is_contiguous():
                comm.bcast_(t.data, root)
            else:  # e.g. channels_last weights: broadcast a contiguous copy, then copy back
                tmp = t.data.contiguous()
                comm.bcast_(tmp, root)
                t.data.copy_(tmp)


def parameter_checksum(module: torch.nn.Module, comm: Communicator) -> tuple[float, float]:
    """(max, min) over ranks of a float64 checksum of the parameters: equal iff in sync."""
    with torch.no_grad():
        c = sum(float(p.double().sum()) + 1e-3 * float(p.double().abs().sum())
                for p in module.parameters())
    buf = torch.tensor([c, -c], dtype=torch.float64)
    comm.allreduce_(buf, op="max")
    return float(buf[0]), float(-buf[1])
