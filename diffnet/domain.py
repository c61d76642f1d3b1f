"""Blocks of a split grid: what a computation on one block of a field needs from the others.

Domain parallelism splits every sample's node grid into blocks, one per rank of a domain group
(``parallel.domain`` in DeepFusion). The science in this package stays free of MPI: a split
computation talks to the other blocks only through a :class:`Block`, whose collectives are
autograd-aware (their backward is the adjoint communication), so a loss computed block by block
has, summed over the blocks, the value and gradient of the undivided one.

:class:`Block` itself is the undivided case, one block covering the whole grid: halos are only
the global-boundary fills, sums and gathers are the identity. It is what every computation uses
unless told otherwise, so the split and the undivided code paths are the same code. DeepFusion's
engine supplies the split implementation (halo exchange and reductions over MPI) with the same
methods.

Geometry: the global grid has ``grid[a]`` nodes on axis ``a`` (axis 0 is the first grid axis of
a (B, C, *grid) tensor, i.e. tensor dim 2); this block holds nodes ``start[a] : start[a] +
shape[a]``. Blocks split every axis into equal parts (``split[a]`` parts on axis a).
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

FILLS = ("zeros", "replicate")


def check_split(grid, split, multiple: int = 1) -> None:
    """ValueError unless ``split`` divides ``grid`` into equal blocks whose every side is a
    multiple of ``multiple`` (a U-Net of depth d needs 2**d), naming valid grids and splits."""
    grid, split = tuple(int(g) for g in grid), tuple(int(s) for s in split)
    if len(split) != len(grid) or any(s < 1 for s in split):
        raise ValueError(f"domain split {list(split)} must give one positive block count per "
                         f"grid axis of grid {list(grid)}")
    bad = [a for a, (g, s) in enumerate(zip(grid, split)) if g % (s * multiple)]
    if not bad:
        return
    a = bad[0]
    m = split[a] * multiple
    near = sorted({max(m, grid[a] // m * m), -(-grid[a] // m) * m})
    splits = [s for s in range(1, split[a] + 3) if grid[a] % (s * multiple) == 0]
    raise ValueError(
        f"grid {'x'.join(map(str, grid))} cannot be split {list(split)} into equal blocks "
        f"whose sides are multiples of {multiple}: axis {a} has {grid[a]} nodes; nearest valid "
        f"sizes of that axis {near}, or {splits[:4] or [1]} blocks along it")


class Block:
    """One block of a node grid (here: the whole grid) and the collectives of a split.

    Args:
        grid: the global grid, one node count per axis.
        start: this block's first node per axis (default: all 0).
        shape: this block's node counts per axis (default: the whole grid).

    Attributes (what a problem's ``impose`` and ``loss_terms`` read of ``self.block``):
        grid, start, shape: the tuples above; the block holds the global nodes
            ``start[a] .. start[a] + shape[a] - 1`` of axis a, and its part of a field is
            (B, C, *shape).
        dims, whole: the number of grid axes; whether the block is the whole grid.

    Geometry (no communication): ``at_lo(a)``, ``at_hi(a)`` (does it hold a global wall),
    ``indices(a)`` (its global node indices), ``local(field)`` (its part of a global field),
    ``nodes()`` (the GLOBAL node count), ``at_shape(shape)`` and ``in_grid(grid)`` (the same
    place on a coarser or another grid). Collectives, which EVERY block of the split must call
    in the same order (a block that skips one leaves the others waiting): ``halo``, ``sum``,
    ``gather``, ``gather_whole``.

    Subclasses that really split override the collectives ``halo``, ``sum`` and ``gather``;
    the geometry helpers below are shared.
    """

    def __init__(self, grid, start=None, shape=None):
        self.grid = tuple(int(g) for g in grid)
        self.start = tuple(int(s) for s in start) if start is not None else (0,) * len(self.grid)
        self.shape = tuple(int(s) for s in shape) if shape is not None else self.grid
        assert len(self.start) == len(self.shape) == len(self.grid), (grid, start, shape)
        assert all(0 <= s and s + n <= g for s, n, g in zip(self.start, self.shape, self.grid))

    @property
    def dims(self) -> int:
        """The number of grid axes (1, 2 or 3)."""
        return len(self.grid)

    @property
    def whole(self) -> bool:
        """True when this block is the whole grid (nothing to exchange)."""
        return self.shape == self.grid

    def at_lo(self, axis: int) -> bool:
        """Does this block hold the global grid's first node along ``axis``?"""
        return self.start[axis] == 0

    def at_hi(self, axis: int) -> bool:
        """Does this block hold the global grid's last node along ``axis``?"""
        return self.start[axis] + self.shape[axis] == self.grid[axis]

    def local(self, field: torch.Tensor) -> torch.Tensor:
        """This block of a global field (..., *grid): a view, no copy."""
        assert tuple(field.shape[-self.dims:]) == self.grid, (field.shape, self.grid)
        lead = field.dim() - self.dims
        for a, (s, n) in enumerate(zip(self.start, self.shape)):
            field = field.narrow(lead + a, s, n)
        return field

    def indices(self, axis: int, like: torch.Tensor | None = None) -> torch.Tensor:
        """The global node indices of this block along ``axis`` (int64, 1-D)."""
        device = like.device if like is not None else None
        return torch.arange(self.start[axis], self.start[axis] + self.shape[axis], device=device)

    def nodes(self) -> int:
        """Number of nodes of the GLOBAL grid (a mean over the field divides by this)."""
        return math.prod(self.grid)

    def at_shape(self, shape) -> "Block":
        """This block on a coarser level of the grid, where it holds ``shape`` nodes: the grid
        and the block coarsened by an integer factor per axis (asserted to divide the start
        and the grid). A U-Net's deeper levels: the neighbours and the collectives are the
        same, only the geometry scales (a shallow copy; halo, sum and gather read the geometry
        from ``start``, ``shape`` and ``grid`` only)."""
        shape = tuple(int(m) for m in shape)
        assert len(shape) == self.dims, (shape, self)
        if shape == self.shape:
            return self
        start, grid = [], []
        for s, n, g, m in zip(self.start, self.shape, self.grid, shape):
            f = n // m if 0 < m <= n else 0
            assert f and n == f * m and s % f == 0 and g % f == 0, (shape, self)
            start.append(s // f)
            grid.append(g // f)
        coarse = copy.copy(self)
        coarse.start, coarse.shape, coarse.grid = tuple(start), shape, tuple(grid)
        return coarse

    def in_grid(self, grid) -> "Block":
        """The block at this one's place in the same split of another ``grid`` (a prolonged
        network's inner grid): the split must divide ``grid`` too (ValueError naming the
        fix). The neighbours and collectives are the same; only the geometry changes."""
        grid = tuple(int(g) for g in grid)
        if grid == self.grid:
            return self
        split = [g // n for g, n in zip(self.grid, self.shape)]
        check_split(grid, split)
        other = copy.copy(self)
        other.shape = tuple(g // s for g, s in zip(grid, split))
        other.start = tuple(a // n * m for a, n, m in zip(self.start, self.shape, other.shape))
        other.grid = grid
        return other

    # -- collectives (the undivided case) ---------------------------------------------------
    def halo(self, x: torch.Tensor, width: int = 1, fill: str = "zeros") -> torch.Tensor:
        """x (B, C, *shape) padded by ``width`` ghost layers on every side of every axis.

        Ghosts inside the global grid hold the neighbouring blocks' nodes (edges and corners
        included); ghosts beyond the global boundary hold ``fill``: "zeros" (a convolution's
        zero padding) or "replicate" (copies of the boundary layer, as bilinear upsampling with
        align_corners=False clamps). The backward adds each ghost's gradient to the node it
        copies. Undivided: F.pad.
        """
        if fill not in FILLS:
            raise ValueError(f"fill must be one of {FILLS}, got {fill!r}")
        pad = [width] * (2 * self.dims)
        if fill == "zeros":
            return F.pad(x, pad)
        return F.pad(x, pad, mode="replicate")

    #: Whether :meth:`ghost_slabs` / :meth:`add_ghost_grads` are implemented (the copy-free
    #: split convolution of ``diffnet.ghost_conv`` needs them; without, layers use ``halo``).
    thin_ghosts = False

    def ghost_slabs(self, x: torch.Tensor, width: int) -> list:
        """The ghost layers ``halo(x, width, "zeros")`` would add, as thin slabs and without
        autograd: one (lo, hi) pair per axis, None where the block is on the global boundary
        (zeros). The slab of axis a spans the PADDED extent (n + 2 width) of the axes before a,
        ``width`` layers along a, and the interior of the axes after a, so every ghost node is
        in exactly one slab. The adjoint is :meth:`add_ghost_grads`."""
        if self.whole:
            return [(None, None)] * self.dims
        raise NotImplementedError(f"{type(self).__name__} has no thin ghost exchange")

    def slabs_of(self, padded: torch.Tensor, width: int) -> list:
        """The slabs of :meth:`ghost_slabs` cut from ``padded``, this block with ``width`` ghost
        layers (what ``halo`` returns): views, None on the global boundary. The definition the
        thin exchange is tested against."""
        out = []
        for a in range(self.dims):
            core = padded
            for b in range(a + 1, self.dims):
                core = core.narrow(2 + b, width, self.shape[b])
            out.append([None if self.at_lo(a) else core.narrow(2 + a, 0, width),
                        None if self.at_hi(a) else core.narrow(2 + a, width + self.shape[a],
                                                               width)])
        return out

    def add_ghost_grads(self, grad_x: torch.Tensor, grads: list, width: int) -> None:
        """The adjoint of :meth:`ghost_slabs`: ``grads`` holds a gradient (or None: zero) per
        slab; each is sent back to the block it was copied from and added there, in place, to
        ``grad_x`` (the gradient of the slabs' ``x``, modified in place)."""
        if not self.whole:
            raise NotImplementedError(f"{type(self).__name__} has no thin ghost exchange")

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the blocks of the split (every block gets the total); the backward
        sums the gradients likewise. Undivided: ``t``."""
        return t

    def gather(self, t: torch.Tensor, axis: int) -> torch.Tensor:
        """The whole of grid axis ``axis`` from the blocks along it: ``t`` is (..., n) with n =
        ``shape[axis]`` in its LAST dim and the result (..., grid[axis]) (blocks in order along
        that axis; blocks that differ on other axes are not involved). The backward returns
        each block its slice of the gradient, summed over the blocks that gathered. Undivided:
        ``t``."""
        return t

    def gather_whole(self, t: torch.Tensor) -> torch.Tensor:
        """The whole field (B, C, *grid) on every block from each block's ``t`` (B, C, *shape):
        :meth:`gather` along every axis in turn (its adjoint: each block gets its slice of the
        gradient, summed over the blocks). Undivided: ``t``."""
        for a in range(self.dims):
            t = self.gather(t.movedim(2 + a, -1), a).movedim(-1, 2 + a)
        return t

    def __repr__(self) -> str:
        return f"{type(self).__name__}(grid={self.grid}, start={self.start}, shape={self.shape})"
