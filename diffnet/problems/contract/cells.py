"""Coarsening a nodal field, exact on a split grid: the means of a field over cells of m nodes
per axis, each cell returned by exactly one block (a coarse field of a multilevel loss term, a
cell-averaged residual, a coarse target).

Cells: along axis a the grid's nodes 0 .. n - 1 fall in cells J = 0 .. ceil(n / m) - 1, cell J
holding nodes m J .. min(m J + m, n) - 1 (the last cell has fewer nodes when m does not divide
n; its mean divides by its own count). A cell belongs to the block that holds its FIRST node
m J, so the block's cells are those with start <= m J < start + shape along every axis
(:func:`block_cells`): each cell of the grid lies on exactly one block, and a plain sum over
the block's cells (``(w * c.square()).sum(dims)``) is its part of the sum over all cells.

Split grid: when m divides the blocks' side along every axis, the block's cells are its own
nodes' (no exchange). Otherwise cells straddle blocks: each block sums its nodes into the
cells they fall in, the partial sums of all cells are summed over the split (``block.sum``, a
(B, C, *all cells) tensor: small for the coarse cells where it happens) and each block keeps
its cells. Either way the means are the undivided ones, and so are their gradients.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from diffnet.domain import Block


def _block(where) -> Block:
    return where if isinstance(where, Block) else where.block


def cell_sides(where, m) -> tuple[int, ...]:
    """``m`` (an int, or one per grid axis) as a cell side >= 1 per axis, at most the grid's
    nodes; ValueError naming the grid otherwise."""
    block = _block(where)
    sides = (m,) * block.dims if isinstance(m, int) else tuple(m)
    if len(sides) != block.dims or any(not isinstance(k, int) or isinstance(k, bool) or
                                       not 1 <= k <= g for k, g in zip(sides, block.grid)):
        raise ValueError(f"cells must have an integer side >= 1 (an int, or one per grid axis), "
                         f"at most the grid {list(block.grid)}, got {m!r}")
    return sides


def block_cells(where, m) -> list[range]:
    """Per grid axis, the global indices of the cells of side ``m`` that belong to the block of
    ``where`` (a problem: its ``block``; or a Block): those whose first node it holds. Cut a
    global per-cell weight w (..., *cells) to the block with them: ``w[..., r0.start:r0.stop,
    r1.start:r1.stop]``."""
    block = _block(where)
    out = []
    for s, n, k in zip(block.start, block.shape, cell_sides(block, m)):
        out.append(range(-(-s // k), -(-(s + n) // k)))
    return out


def cell_means(where, t: torch.Tensor, m) -> torch.Tensor:
    """(B, ..., *cells) the mean of t (B, ..., *shape) over each cell of side ``m`` nodes (an
    int, or one per grid axis) that belongs to the block of ``where`` (a problem or a Block):
    the module docstring's rule. Undivided: every cell of the grid, in order."""
    block = _block(where)
    sides = cell_sides(block, m)
    d = block.dims
    lead = t.dim() - d
    if lead < 1 or tuple(t.shape[lead:]) != block.shape:
        raise ValueError(f"t must be a field on the block, (B, ..., *{list(block.shape)}), got "
                         f"{tuple(t.shape)}")
    own = block_cells(block, sides)
    if block.whole or all(n % k == 0 for n, k in zip(block.shape, sides)):
        sums = _cell_sums(t, sides, (0,) * d)
    else:   # cells straddle blocks: every block's partial sums, summed over the split
        part = _cell_sums(t, sides, tuple(s % k for s, k in zip(block.start, sides)))
        sums = summed_over_split(block, part, sides)
        for a, r in enumerate(own):
            sums = sums.narrow(lead + a, r.start, len(r))
    return sums / _counts(block.grid, sides, own, t)


def summed_over_split(block, part: torch.Tensor, sides) -> torch.Tensor:
    """(..., *all cells) the grid's cell sums from every block's partial ones: ``part``
    (..., *cells it touches) holds the block's sums over the cells of side ``sides`` its nodes
    fall in, the first one the cell of its first node; each is placed among the grid's
    ceil(n / side) cells per axis and the placed tensors are summed over the split
    (``block.sum``, a collective: every block calls it)."""
    d = block.dims
    lead = part.dim() - d
    pad = []
    for a in reversed(range(d)):
        first, total = block.start[a] // sides[a], -(-block.grid[a] // sides[a])
        pad += [first, total - first - part.shape[lead + a]]
    return block.sum(F.pad(part, pad))


def _cell_sums(t: torch.Tensor, sides, offset) -> torch.Tensor:
    """The sums of t over the cells its nodes fall in, its first node ``offset[a]`` nodes into
    its first cell along axis a (zeros for the nodes it does not hold)."""
    d = len(sides)
    lead = t.dim() - d
    for a, (k, off) in enumerate(zip(sides, offset)):
        dim, n = lead + a, t.shape[lead + a]
        cells = -(-(off + n) // k)
        t = F.pad(t, [0, 0] * (d - 1 - a) + [off, cells * k - off - n])
        t = t.unflatten(dim, (cells, k)).sum(dim + 1)
    return t


def _counts(grid, sides, own, like) -> torch.Tensor:
    """(*cells) the number of grid nodes in each of the block's cells ``own``."""
    out = like.new_ones(())
    for n, k, r in zip(grid, sides, own):
        j = torch.arange(r.start, r.stop, device=like.device)
        out = out.unsqueeze(-1) * (torch.clamp(n - k * j, max=k)).to(like.dtype)
    return out
