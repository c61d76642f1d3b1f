"""Split-exact helpers: the reductions a loss is written with so that it is exact on any block
of a split grid (``diffnet.domain.Block``), in 1, 2 or 3 dimensions, with no block code in the
loss.

A loss term returns, on each block, its PART: summed over the blocks of a split, the parts are
the undivided term, value and gradient ("Domain parallelism" in :mod:`.base`). A loss built
only from the pieces below has that property on every block, and on the whole grid (the
undivided :class:`~diffnet.domain.Block`) each piece takes the plain torch path, so the
undivided arithmetic is what one would write without a split:

* ``node_mean(b, t, interior)``: per-sample mean over the nodes (global indices ``interior``
  nodes or more from the boundary): a residual's mean square;
* ``wall_mean(b, t, axis, side)``: per-sample mean over one boundary row / column / face,
  counted on the blocks that hold it: a soft boundary condition;
* ``edges(b, t, axes)``: the two end nodes of every edge between neighbouring nodes that the
  block owns (each edge of the grid once): energies and fluxes on edges;
* ``total(b, part)``: the sum of the blocks' parts, on every block: the inside of a
  non-linear reduction (a norm, a ratio); ``share(b, value)``: this block's share of a value
  every block holds (a function of totals), so that the shares add up to it;
* ``cut(b, field)``: the block's part of a global mask or weight (size-1 axes kept);
  ``block_coords(problem, b)``: the 1-D node coordinates of the block, so that a field
  evaluated pointwise on them is the whole grid's field cut to the block, bit for bit.

Built from these, also split-exact: boundary data (:mod:`.boundary`: a Dirichlet lift,
Neumann and Robin terms) and the means of a field over coarse cells (:mod:`.cells`).

A plain per-node sum ``t.sum(dims)`` (a quadrature with weights cut by ``cut``) needs nothing:
every node lies on exactly one block. Derivatives come from
``diffnet.stencils.FiniteDifference(u, block)``, which exchanges the halo itself.
:class:`~diffnet.problems.contract.base.Problem` offers each helper as a method on its own block
(``self.mean``, ``self.wall_mean``, ``self.edges``, ``self.total``, ``self.share``,
``self.part``). Fields are (B, ..., *grid): the batch first, the grid axes last, anything
between (channels) averaged over too. Example, a residual and a condition on the wall y = 0::

    r = self.fd(u, self.block)[:, 1:2] - inputs[:, :1]                # (B, 1, H, W)
    pde = self.mean(r.square(), interior=1)
    bc = self.wall_mean(u.square(), axis=0, side="lo")
"""
from __future__ import annotations

import math

import numpy as np
import torch

from diffnet.domain import Block

SIDES = ("lo", "hi")


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


def block_coords(problem, block: Block | None = None) -> list[np.ndarray]:
    """The 1-D node coordinates of ``block`` of ``problem``'s grid (default: the whole grid),
    one array per axis in grid order: slices of ``problem.coords()``, so a field evaluated
    pointwise on them is the whole grid's field cut to the block, bit for bit. ValueError if
    ``block`` is a block of another grid."""
    block = Block(problem.grid) if block is None else block
    if tuple(block.grid) != tuple(problem.grid):
        raise ValueError(f"block {block!r} is a block of grid {list(block.grid)}, but problem "
                         f"{problem.name!r} is on grid {list(problem.grid)}")
    c = problem.coords()
    return [c[a.name][s:s + n] for a, s, n in zip(problem.axes, block.start, block.shape)]


def margins(block, interior) -> tuple[int, ...]:
    """``interior`` as one non-negative margin per grid axis, each leaving a node."""
    m = (interior,) * block.dims if isinstance(interior, int) else tuple(interior)
    if len(m) != block.dims or any(not isinstance(v, int) or v < 0 or 2 * v >= g
                                   for v, g in zip(m, block.grid)):
        raise ValueError(f"interior must be an integer >= 0 or one per grid axis, leaving "
                         f"nodes of grid {list(block.grid)}, got {interior!r}")
    return m


def node_mean(block, t: torch.Tensor, interior=0) -> torch.Tensor:
    """(B,) mean of t (B, ..., *shape) over the nodes at least ``interior`` nodes (an int, or
    one per axis) from the global boundary, and over the dims between batch and grid; on a
    split block, its part: the sum over its nodes there divided by the GLOBAL count."""
    m = margins(block, interior)
    lead, dims = t.dim() - block.dims, tuple(range(1, t.dim()))
    if block.whole:
        if any(m):      # a contiguous copy sums in the order of a field computed on the cut
            for a, k in enumerate(m):
                t = t.narrow(lead + a, k, block.grid[a] - 2 * k)
            t = t.contiguous()
        return t.mean(dim=dims)
    count = math.prod(t.shape[1:lead]) * math.prod(g - 2 * k for g, k in zip(block.grid, m))
    for a, (k, s, n, g) in enumerate(zip(m, block.start, block.shape, block.grid)):
        lo, hi = max(k - s, 0), min(g - k - s, n)      # global [k, g - k) in local indices
        t = t.narrow(lead + a, lo, max(hi - lo, 0))
    return t.sum(dim=dims) / count


def check_wall(block, axis: int, side: str) -> None:
    """ValueError unless (``axis``, ``side``) names a wall of ``block``'s grid."""
    if side not in SIDES or not 0 <= axis < block.dims:
        raise ValueError(f"a wall is an axis in 0..{block.dims - 1} and a side in {SIDES}, "
                         f"got axis {axis!r}, side {side!r}")


def holds_wall(block, axis: int, side: str) -> bool:
    """Does ``block`` hold the wall of grid ``axis`` on ``side``?"""
    return block.at_lo(axis) if side == "lo" else block.at_hi(axis)


def wall_mean(block, t: torch.Tensor, axis: int, side: str) -> torch.Tensor:
    """(B,) mean of t (B, ..., *shape) over the boundary nodes of grid ``axis`` on ``side``
    ("lo": index 0, "hi": the last); on a split block, its part: the sum over the wall nodes
    it holds divided by the GLOBAL count of the wall's nodes, zero on a block away from it."""
    check_wall(block, axis, side)
    lead = t.dim() - block.dims
    wall = t.select(lead + axis, 0 if side == "lo" else -1)
    dims = tuple(range(1, wall.dim()))
    if block.whole:
        return wall.contiguous().mean(dim=dims)
    if not holds_wall(block, axis, side):
        return t.new_zeros(t.shape[0])
    count = math.prod(t.shape[1:lead]) * math.prod(block.grid) // block.grid[axis]
    return wall.sum(dim=dims) / count


def edges(block, t, axes=None) -> list[tuple]:
    """(first, second) end nodes of the edges (i, i + 1) along each grid axis of ``axes``
    (default: all, in order) that this block owns, from t (B, C, *shape), or from a tuple of
    such fields (then first and second are tuples too); one halo exchange for all.

    An edge belongs to the block holding node i, so every edge of the grid counts on one
    block; undivided, the first and second nodes are t[..., :-1] and t[..., 1:] along the axis.
    Each is (B, C, ...) with the block's nodes along the other axes and its edges along
    ``axis`` (one fewer than nodes on the block holding the global last node)."""
    axes = tuple(range(block.dims)) if axes is None else tuple(axes)
    many = isinstance(t, (tuple, list))
    fields = tuple(t) if many else (t,)
    if block.whole:     # every axis cut from one view, as a split block cuts them from its halo
        views = [f.view_as(f) for f in fields]
        out = [tuple(zip(*(_whole_edges(v, 2 + a) for v in views))) for a in axes]
    else:
        channels = [f.shape[1] for f in fields]
        p = block.halo(torch.cat(fields, dim=1) if many else t, 1)
        out = [tuple(e.split(channels, dim=1) for e in owned_edges(p, block, a)) for a in axes]
    return out if many else [(first[0], second[0]) for first, second in out]


def _whole_edges(t: torch.Tensor, dim: int):
    """(first, second) nodes of the edges of the whole grid along tensor dim ``dim``."""
    n = t.shape[dim]
    # the second end cut first, as ``t[1:] - t[:-1]`` does: autograd then adds the two ends'
    # gradients in the order of that plain expression
    second = t.narrow(dim, 1, n - 1)
    return t.narrow(dim, 0, n - 1), second


def lines_along(p: torch.Tensor, block, axis: int) -> torch.Tensor:
    """The lines along grid ``axis`` through the block's own nodes of ``p = block.halo(x, 1)``
    (B, C, *shape + 2): the halo kept along ``axis`` only."""
    for a, n in enumerate(block.shape):
        if a != axis:
            p = p.narrow(2 + a, 1, n)
    return p


def owned_edges(p: torch.Tensor, block, axis: int):
    """(first, second) nodes of the edges along grid ``axis`` that this block owns, from
    ``p = block.halo(x, 1)`` (B, C, *shape + 2): see :func:`edges`."""
    p = lines_along(p, block, axis)
    count = block.shape[axis] - int(block.at_hi(axis))
    dim = 2 + axis
    return p.narrow(dim, 1, count), p.narrow(dim, 2, count)


def total(block, part: torch.Tensor) -> torch.Tensor:
    """The sum of every block's ``part`` (per-sample partial sums, e.g. ``t.sum(dims)``), on
    every block, differentiably: the inside of a reduction that is not a sum over nodes. Give
    a function of it back with :func:`share`. Undivided: ``part``."""
    return block.sum(part)


def share(block, value: torch.Tensor) -> torch.Tensor:
    """This block's share of ``value``, a quantity every block of the split holds (a function
    of :func:`total`): value / number of blocks, so the shares sum to it and the gradients,
    through ``total``'s backward, to its gradient. Undivided: ``value`` (divided by 1)."""
    blocks = math.prod(g // n for g, n in zip(block.grid, block.shape))
    return value if blocks == 1 else value / blocks


def mean_part(t: torch.Tensor, dims, count: int, block) -> torch.Tensor:
    """``t.mean(dims)`` when undivided; on a split block, the sum over its nodes divided by
    the GLOBAL number ``count`` of averaged nodes (a field not on the block's nodes, e.g. only
    the rows after the first: :func:`node_mean` covers fields on the block's nodes)."""
    if block.whole:
        return t.mean(dim=dims)
    return t.sum(dim=dims) / count


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


def block_and_spacing(where, spacing, who: str) -> tuple:
    """(block, spacing) of a residual norm's ``where``: a problem (its block, and its spacing
    unless given) or a Block with ``spacing`` given; ValueError naming ``who`` otherwise."""
    block = where if isinstance(where, Block) else where.block
    if not isinstance(where, Block) and spacing is None:
        spacing = where.spacing
    if spacing is None:
        raise ValueError(f"{who} on a Block needs spacing=(h, ...) per grid axis; or pass the "
                         f"problem, whose spacing it takes")
    spacing = tuple(float(h) for h in spacing)
    if len(spacing) != block.dims or not all(h > 0 for h in spacing):
        raise ValueError(f"spacing must give a positive spacing per grid axis of "
                         f"{list(block.grid)}, got {spacing!r}")
    return block, spacing


def interior_mask(block, interior, like: torch.Tensor) -> torch.Tensor:
    """(*shape) 1 at the block's nodes ``interior`` or more from the grid's boundary (by global
    index: an int, or one per axis), 0 elsewhere, in ``like``'s dtype."""
    mask = like.new_ones(())
    for a, (k, g) in enumerate(zip(margins(block, interior), block.grid)):
        i = block.indices(a, like)
        mask = mask.unsqueeze(-1) * ((i >= k) & (i < g - k)).to(like.dtype)
    return mask


def one_field_shape(t: torch.Tensor, block, what: str) -> tuple:
    """The shape (B, 1, *shape) a nodal field ``t`` on ``block``, (B, *shape) or (B, 1,
    *shape), is taken as; ValueError naming ``what`` (e.g. "operator_norm: r") otherwise."""
    d = block.dims
    if t.dim() == d + 1 and tuple(t.shape[1:]) == block.shape:
        return (t.shape[0], 1, *block.shape)
    if t.dim() == d + 2 and t.shape[1] == 1 and tuple(t.shape[2:]) == block.shape:
        return tuple(t.shape)
    raise ValueError(f"{what} must be one field on the grid, (B, *{list(block.shape)}) or "
                     f"(B, 1, *{list(block.shape)}), got {tuple(t.shape)} (a system of several "
                     f"fields is not supported: its stencil couples fields)")
