"""Domain parallelism over MPI: the split implementation of :class:`diffnet.domain.Block`.

This module owns the communication of a domain group (the ranks that together hold one
sample's node grid, ``parallel.domain`` blocks per axis): the block geometry of each rank, the
halo exchange with its neighbours, and the sums and gathers over the group, each an autograd
Function whose backward is the adjoint communication. It also owns how a world of ranks is
cut into domain groups (:func:`domain_groups`). diffnet never sees MPI: it only calls the
methods of the :class:`~diffnet.domain.Block` it is handed (:func:`make_block`).

Layout: rank r of a domain group holds block ``np.unravel_index(r, split)`` (row-major over
the split), so the blocks of a group tile the grid in rank order.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from diffnet.domain import FILLS, Block, check_split

from deepfusion.engine.parallel.comm import Communicator
from deepfusion.engine.parallel.data import group_count
from deepfusion.engine.parallel.memformat import memory_format


def _layout(t: torch.Tensor) -> torch.memory_format:
    """The memory format ``t`` is in, so results keep it (channels-last convolutions stay so)."""
    fmt = memory_format(t.dim())
    if fmt is not torch.contiguous_format and not t.is_contiguous() \
            and t.is_contiguous(memory_format=fmt):
        return fmt
    return torch.contiguous_format


def _core(t: torch.Tensor, first: int, width: int, shape) -> torch.Tensor:
    """View of ``t`` narrowed to the interior (``width`` .. ``width + n``) of grid axes >= first."""
    for a in range(first, len(shape)):
        t = t.narrow(2 + a, width, shape[a])
    return t


class MPIBlock(Block):
    """This rank's block of a grid split ``split`` over the domain group ``comm``.

    Args:
        comm: the domain group, ``prod(split)`` ranks laid out row-major over ``split``.
        grid: the global grid, one node count per axis.
        split: blocks per axis (equal blocks: ``check_split(grid, split)`` must pass).
    """

    def __init__(self, comm: Communicator, grid, split):
        check_split(grid, split)
        split = tuple(int(s) for s in split)
        if comm.size != math.prod(split):
            raise ValueError(f"domain split {list(split)} needs {math.prod(split)} ranks in its "
                             f"group, the group has {comm.size}")
        index = tuple(int(i) for i in np.unravel_index(comm.rank, split))
        shape = tuple(int(g) // s for g, s in zip(grid, split))
        super().__init__(grid, [i * n for i, n in zip(index, shape)], shape)
        self.comm, self.split, self.index = comm, split, index
        # Neighbours per axis: group rank of the block one step down / up, None on the boundary.
        self.lo = tuple(self._rank_at(a, -1) for a in range(self.dims))
        self.hi = tuple(self._rank_at(a, +1) for a in range(self.dims))
        # Lines for gather: colour = the block index with axis a zeroed (same for the whole line),
        # key = position along a, so line ranks are in block order. Every rank splits every axis
        # in the same order (Split is collective).
        self.lines = []
        for a in range(self.dims):
            colour = int(np.ravel_multi_index(index[:a] + (0,) + index[a + 1:], split))
            self.lines.append(comm.split(colour, key=index[a]))

    def _rank_at(self, axis: int, step: int) -> int | None:
        i = list(self.index)
        i[axis] += step
        if not 0 <= i[axis] < self.split[axis]:
            return None
        return int(np.ravel_multi_index(i, self.split))

    def halo(self, x, width=1, fill="zeros"):
        if fill not in FILLS:
            raise ValueError(f"fill must be one of {FILLS}, got {fill!r}")
        if x.dim() != 2 + self.dims or tuple(x.shape[2:]) != self.shape:
            raise ValueError(f"halo expects (B, C, *{self.shape}), got {tuple(x.shape)}")
        if not 0 <= width <= min(self.shape):
            raise ValueError(f"halo width {width} exceeds the block {self.shape} (a ghost layer "
                             f"must come from the neighbour's own nodes); use a coarser split")
        if width == 0:
            return x
        return _Halo.apply(x, self, int(width), fill)

    thin_ghosts = True

    def ghost_slabs(self, x, width):
        w, slabs = int(width), []
        for a in range(self.dims):
            d, n = 2 + a, self.shape[a]
            # The layers to send, extended along the earlier axes by their slabs' matching
            # layers (zeros on the global boundary): corners arrive with the later axis.
            sends = [self._extended(x.narrow(d, start, w), slabs, a, start, w)
                     for start in (0, n - w)]
            slabs.append(_exchange(self, a, sends[0], sends[1], tag=a))
        return slabs

    def _extended(self, layer, slabs, axis, start, w):
        for b in range(axis):
            ends = [s.narrow(2 + axis, start, w) if s is not None else None for s in slabs[b]]
            zero = _thin_zeros(layer, 2 + b, w)
            layer = torch.cat([ends[0] if ends[0] is not None else zero, layer,
                               ends[1] if ends[1] is not None else zero], dim=2 + b)
        return layer.contiguous()

    def add_ghost_grads(self, grad_x, grads, width):
        w, shape = int(width), self.shape
        # Own thin copies, zeros for None: the later axes' returns are added to the earlier
        # axes' slabs, every neighbour expects a message, and a side without one still shapes
        # the other side's receive (what lands in it is dropped: boundary ghosts are zeros).
        grads = [[g.clone() if g is not None else grad_x.new_zeros(self._slab_shape(grad_x, a, w))
                  for g in pair] for a, pair in enumerate(grads)]
        for a in reversed(range(self.dims)):          # the adjoint runs the axes backwards
            d, n = 2 + a, shape[a]
            from_lo, from_hi = _exchange(self, a, grads[a][0].contiguous(),
                                         grads[a][1].contiguous(), tag=self.dims + a)
            for got, start in ((from_lo, 0), (from_hi, n - w)):
                if got is None:
                    continue
                for b in reversed(range(a)):          # peel the earlier axes' extensions off
                    m = got.shape[2 + b] - 2 * w
                    grads[b][0].narrow(d, start, w).add_(got.narrow(2 + b, 0, w))
                    grads[b][1].narrow(d, start, w).add_(got.narrow(2 + b, w + m, w))
                    got = got.narrow(2 + b, w, m)
                grad_x.narrow(d, start, w).add_(got)

    def _slab_shape(self, t, axis, w):
        return (tuple(t.shape[:2]) + tuple(n + 2 * w for n in self.shape[:axis]) + (w,)
                + tuple(self.shape[axis + 1:]))

    def sum(self, t):
        return _Sum.apply(t, self.comm)

    def gather(self, t, axis):
        if t.shape[-1] != self.shape[axis]:
            raise ValueError(f"gather along axis {axis} expects {self.shape[axis]} in the last "
                             f"dim, got {tuple(t.shape)}")
        return _Gather.apply(t, self.lines[axis])


def _thin_zeros(t: torch.Tensor, dim: int, w: int) -> torch.Tensor:
    """Zeros shaped like ``t`` but ``w`` thick along ``dim`` (a missing neighbour's ghosts)."""
    shape = list(t.shape)
    shape[dim] = w
    return t.new_zeros(shape)


def _exchange(block: MPIBlock, axis: int, send_lo, send_hi, tag: int):
    """Shift along ``axis`` both ways: ``send_hi`` goes up, ``send_lo`` down. Returns what
    came (from below, from above), None where there is no neighbour. Each Sendrecv moves a
    whole chain at once, so no ordering by rank parity is needed to avoid deadlock."""
    lo, hi = block.lo[axis], block.hi[axis]
    from_lo = torch.empty_like(send_hi) if lo is not None else None
    from_hi = torch.empty_like(send_lo) if hi is not None else None
    if lo is not None or hi is not None:
        block.comm.sendrecv_(send_hi, hi, from_lo, lo, tag=2 * tag)
        block.comm.sendrecv_(send_lo, lo, from_hi, hi, tag=2 * tag + 1)
    return from_lo, from_hi


class _Halo(torch.autograd.Function):
    """Ghost layers from the neighbours, axis by axis, in one padded buffer.

    Axis a works on the view whose axes < a are already padded and axes > a are still the
    interior: its boundary layers then carry the ghosts of the earlier axes along, which is how
    edge and corner ghosts arrive without diagonal messages.
    """

    @staticmethod
    def forward(ctx, x, block, width, fill):
        ctx.block, ctx.width, ctx.fill, ctx.format = block, width, fill, _layout(x)
        w, shape = width, block.shape
        out = torch.empty(tuple(x.shape[:2]) + tuple(n + 2 * w for n in shape), dtype=x.dtype,
                          device=x.device, memory_format=ctx.format)
        _core(out, 0, w, shape).copy_(x)
        for a in range(block.dims):
            view, d, n = _core(out, a + 1, w, shape), 2 + a, shape[a]
            # Contiguous copies: MPI needs dense buffers whatever the tensor's layout.
            from_lo, from_hi = _exchange(block, a, view.narrow(d, w, w).contiguous(),
                                         view.narrow(d, n, w).contiguous(), tag=a)
            for ghost, got, edge in ((view.narrow(d, 0, w), from_lo, w),
                                     (view.narrow(d, w + n, w), from_hi, w + n - 1)):
                if got is not None:
                    ghost.copy_(got)
                elif fill == "zeros":
                    ghost.zero_()
                else:  # replicate: the outermost layer, width times
                    ghost.copy_(view.narrow(d, edge, 1).expand_as(ghost))
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        block, w, shape = ctx.block, ctx.width, ctx.block.shape
        # A fresh buffer: the ghosts' gradients are accumulated into it in place.
        g = torch.empty(grad.shape, dtype=grad.dtype, memory_format=ctx.format).copy_(grad)
        for a in reversed(range(block.dims)):  # the adjoint runs the axes backwards
            view, d, n = _core(g, a + 1, w, shape), 2 + a, shape[a]
            ghost_lo, ghost_hi = view.narrow(d, 0, w), view.narrow(d, w + n, w)
            # A ghost's gradient goes back to the block it was copied from (the reverse shift),
            # tags distinct from the forward's.
            from_lo, from_hi = _exchange(block, a, ghost_lo.contiguous(), ghost_hi.contiguous(),
                                         tag=block.dims + a)
            for layers, got, ghost, edge in ((view.narrow(d, n, w), from_hi, ghost_hi, w + n - 1),
                                             (view.narrow(d, w, w), from_lo, ghost_lo, w)):
                if got is not None:
                    layers.add_(got)
                elif ctx.fill == "replicate":  # every copy of the outermost layer adds to it
                    view.narrow(d, edge, 1).add_(ghost.sum(d, keepdim=True))
                # zeros on the global boundary: constants, their gradient is dropped
        return _core(g, 0, w, shape).contiguous(memory_format=ctx.format), None, None, None



class _Sum(torch.autograd.Function):
    """Allreduce SUM over the group; its adjoint is the same allreduce of the gradients."""

    @staticmethod
    def forward(ctx, t, comm):
        ctx.comm = comm
        out = t.detach().clone(memory_format=torch.contiguous_format)  # never the input in place
        comm.allreduce_(out.view(-1))
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        g = grad.clone(memory_format=torch.contiguous_format)
        ctx.comm.allreduce_(g.view(-1))
        return g, None


class _Gather(torch.autograd.Function):
    """Allgather over a line, pieces concatenated along the last dim in block order; the
    adjoint sums the full-length gradients over the line and keeps this block's slice."""

    @staticmethod
    def forward(ctx, t, line):
        ctx.line = line
        piece = t.detach().contiguous()
        pieces = piece.new_empty((line.size,) + tuple(piece.shape))
        line.allgather_(piece, pieces)
        # (L, ..., n) -> (..., L, n) -> (..., L * n): line rank order is block order.
        return pieces.movedim(0, -2).reshape(tuple(piece.shape[:-1]) + (-1,))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        # Reduce-scatter as an allreduce then a slice: these are profiles along one axis, small
        # next to the fields, and it keeps the communicator to the calls it already has.
        g = grad.clone(memory_format=torch.contiguous_format)
        ctx.line.allreduce_(g.view(-1))
        n = g.shape[-1] // ctx.line.size
        return g.narrow(-1, ctx.line.rank * n, n).contiguous(), None


def make_block(comm: Communicator, grid, split) -> Block:
    """This rank's block of ``grid`` split ``split`` over the domain group ``comm``; the plain
    undivided :class:`~diffnet.domain.Block` when the split is one block (no communication)."""
    if math.prod(int(s) for s in split) == 1:
        check_split(grid, split)
        return Block(grid)
    return MPIBlock(comm, grid, split)


def domain_groups(world: Communicator, split):
    """Cut ``world`` (P ranks) into P // D consecutive domain groups of D = prod(split) ranks:
    ranks [g*D, (g+1)*D) form group g. Returns (domain_comm, across_comm, group_index,
    n_groups); ``across_comm`` links the ranks at the same position of every group (the
    data-parallel gradient allreduce of one block's share of the model runs over it)."""
    n_groups = group_count(world.size, split)
    d = world.size // n_groups
    group, pos = world.rank // d, world.rank % d
    return world.split(group, key=pos), world.split(pos, key=group), group, n_groups
