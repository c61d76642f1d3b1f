"""Pieces the problems' losses share on a block of a split grid (``diffnet.domain.Block``).

Owns the arithmetic that turns an undivided per-sample term into this block's part of it
(see "Domain parallelism" in ``base``): cutting global masks to the block, means over the field
as partial sums over the block's nodes, and the edges between nodes that a block owns.
"""
from __future__ import annotations

import torch


def cut(block, field: torch.Tensor) -> torch.Tensor:
    """This block's part of a global field (..., *grid) whose grid axes may have size 1
    (broadcast masks and weights keep those); ``field`` itself when the block is whole."""
    if block.whole:
        return field
    lead = field.dim() - block.dims
    for a, (s, n) in enumerate(zip(block.start, block.shape)):
        if field.shape[lead + a] != 1 or block.grid[a] == 1:
            field = field.narrow(lead + a, s, n)
    return field


def mean_part(t: torch.Tensor, dims, count: int, block) -> torch.Tensor:
    """``t.mean(dims)`` when undivided; this block's part of it, the sum over its nodes divided
    by the GLOBAL number ``count`` of averaged nodes, on a split block."""
    if block.whole:
        return t.mean(dim=dims)
    return t.sum(dim=dims) / count


def owned_edges(p: torch.Tensor, block, axis: int):
    """(first, second) nodes of the edges along grid ``axis`` that this block owns, from
    ``p = block.halo(x, 1)`` (B, C, *shape + 2).

    An edge (i, i + 1) belongs to the block holding node i, so every edge of the grid counts
    once; the block reads node i + 1 from the halo, and the last block along ``axis`` has one
    edge fewer than nodes. Both results are (B, C, ...) with this block's nodes along the other
    axes and its edges along ``axis``.
    """
    for a, n in enumerate(block.shape):
        if a != axis:
            p = p.narrow(2 + a, 1, n)
    edges = block.shape[axis] - int(block.at_hi(axis))
    dim = 2 + axis
    return p.narrow(dim, 1, edges), p.narrow(dim, 2, edges)


def check_halo_width(block, width: int, what: str) -> None:
    """ValueError unless a halo of ``width`` layers is no wider than the block along every
    axis: a split halo takes its ghosts from the immediate neighbours' own nodes (the MPI
    block's rule, which checks every axis)."""
    if block.whole or width <= min(block.shape):
        return
    a = min(range(block.dims), key=lambda i: block.shape[i])
    raise ValueError(
        f"{what} needs a halo of {width} layers on a split grid, but the blocks of {block!r} "
        f"have only {block.shape[a]} nodes along axis {a}: use fewer blocks (or a shorter "
        f"horizon) so that every block side is >= {width}")
