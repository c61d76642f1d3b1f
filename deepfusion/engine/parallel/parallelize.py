"""The one place that makes a built model parallel: :func:`parallelize`.

As in torchtitan, parallelism is applied to an already built model by one function; the trainer
receives the result and does not know how it is parallel. That is data parallelism:

1. broadcast rank 0's parameters and buffers, so every rank starts equal;
2. gradient synchronisation: every ``.grad`` becomes a view into flat buckets that are summed
   over the ranks in place (:class:`~deepfusion.engine.parallel.gradsync.GradSync`, with optional
   overlap of the allreduce with backward);
3. optionally ``torch.compile`` of the forward (same parameters, so gradients still land in
   the buckets);
4. with ``parallel.domain``, the domain split: the ranks form groups of prod(domain) ranks
   that share every sample, one block of its grid each (:class:`Domain`); the generator's
   layers are made to compute on the block (``diffnet.split_layers``), and the groups are the
   data-parallel units. The gradient buckets are still summed over ALL ranks: a rank's
   gradient is its block's part of its samples' gradient, so the sum over the blocks of a
   group is the group's gradient and the sum over the groups the global one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from diffnet.domain import Block
from diffnet.split_layers import split_generator

from deepfusion.engine.parallel.comm import Communicator
from deepfusion.engine.parallel.gradsync import GradSync
from deepfusion.engine.parallel.halo import domain_groups, make_block


@dataclass
class Domain:
    """This rank's place in a domain split: its group, and its block of the current grid."""

    split: tuple[int, ...]             # blocks per grid axis (parallel.domain)
    comm: Communicator                 # the ranks of this group: they share every sample
    group: int                         # which data-parallel group this rank belongs to
    groups: int                        # how many groups there are
    block: Block                       # this rank's block of the current grid

    def on_grid(self, grid) -> Block:
        """This rank's block of ``grid`` (a multigrid level changes the grid)."""
        if tuple(grid) != self.block.grid:
            self.block = make_block(self.comm, tuple(grid), self.split)
        return self.block


@dataclass
class ParallelModel:
    """A model made parallel: what the step and the trainer use instead of the bare module."""

    module: torch.nn.Module            # the model as built: its state_dict is what is saved
    forward: Callable                  # what runs it: the module or its compiled wrapper
    comm: Communicator                 # the ranks whose gradients are summed
    grads: GradSync                    # the flat gradient buckets
    cfg: object = None                 # the [parallel] section applied
    compiled: bool = False
    domain: Domain | None = None       # the domain split, if any

    @property
    def data_rank(self) -> int:
        """This rank's index among the data-parallel units (the groups, under a split)."""
        return self.domain.group if self.domain else self.comm.rank

    @property
    def data_size(self) -> int:
        """The number of data-parallel units: the ranks, or the groups under a split."""
        return self.domain.groups if self.domain else self.comm.size

    def block(self, grid) -> Block:
        """This rank's block of ``grid``, with the network's layers set to compute on it (the
        whole grid without a split)."""
        if self.domain is None:
            return Block(grid)
        block = self.domain.on_grid(grid)
        split_generator(self.module, block)
        return block

    def rewrap(self, module: torch.nn.Module, grid) -> "ParallelModel":
        """The same parallelism applied to another module (a grown one that contains this
        one's, or the one it grew from after a rollback), split on ``grid``, the grid it
        trains on next (a network need not suit the grid of the one it replaces): this one's
        gradient buckets let go of the parameters first."""
        self.grads.close()
        if self.domain is not None:
            self.domain.on_grid(grid)
        return parallelize(module, self.comm, self.cfg, compile=self.compiled,
                           domain=self.domain)

    def parameters(self):
        return self.module.parameters()

    def checksum(self) -> tuple[float, float]:
        """(max, min) over ranks of a checksum of the parameters: equal iff in sync."""
        return parameter_checksum(self.module, self.comm)


def parallelize(model: torch.nn.Module, comm: Communicator, cfg, *, compile: bool = False,
                grid=None, domain: Domain | None = None) -> ParallelModel:
    """Apply the parallelism of ``cfg`` (a ``[parallel]`` section) to a built ``model``;
    ``grid`` is the first grid it trains on (needed by a domain split, whose blocks depend on
    it); ``domain`` reuses an existing split (a grown network keeps its ranks' groups)."""
    broadcast_module(model, comm)
    if domain is None and cfg.blocks() > 1:
        assert grid is not None, "a domain split needs the grid it starts on"
        domain = make_domain(comm, cfg.domain, grid)
    if domain is not None:
        split_generator(model, domain.block)
    grads = GradSync(model, comm, bucket_mb=cfg.bucket_mb, overlap=cfg.overlap)
    forward = torch.compile(model, dynamic=False) if compile else model
    return ParallelModel(model, forward, comm, grads, cfg, compile, domain)


def make_domain(comm: Communicator, split, grid) -> Domain | None:
    """The domain split ``split`` (blocks per axis) of ``grid`` over ``comm``'s ranks: groups
    of prod(split) consecutive ranks, this rank's block; None when prod(split) is 1."""
    split = tuple(int(s) for s in split)
    if not split or all(s == 1 for s in split):
        return None
    dcomm, _across, group, groups = domain_groups(comm, split)
    return Domain(split, dcomm, group, groups, make_block(dcomm, tuple(grid), split))


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
