"""Boundary data as part of the contract: non-zero Dirichlet values imposed exactly through a
lift, Neumann and Robin conditions as loss terms, and the node coordinates and bubble a problem
builds them from; every piece exact on a block of a split grid (:mod:`.blocks`).

A wall is one side of one grid axis, named ``"<axis name>_lo"`` or ``"<axis name>_hi"`` (the
problem's ``axes``: ``"x_hi"`` is the wall x = hi), or given as ``(axis index, "lo" | "hi")``;
``walls=None`` means every wall.

Dirichlet, u = g on the chosen walls, exactly (``impose``)::

    u = G + scale * bubble * N

N the network's output; bubble = prod over the axes of 4 t (1 - t), t = (x - lo) / (hi - lo),
zero on the walls and 1 at the centre (an axis with one Dirichlet wall: t (2 - t) or
1 - t^2, zero there and 1 with zero slope at the other wall, which a Neumann condition then
owns); G any field equal to g on those walls. :func:`dirichlet` takes G as a field (a channel
of the inputs, an array) or g as a function of the coordinates, which it extends inside by
transfinite (Coons) interpolation of the wall values (:func:`transfinite_lift`, also the way
to build a lift channel in ``build_input``). ``scale`` is the size of u - G.

Neumann and Robin, du/dn = q and a u + b du/dn = c on the chosen walls (``loss_terms``):
du/dn is the outward normal derivative by the one-sided second-order difference
(3 u_0 - 4 u_1 + u_2) / (2 h) (u_0 on the wall, u_1, u_2 the next nodes inward), and the term
is the boundary mean of the squared residual, (1 / |Gamma|) int_Gamma r^2 dS over the chosen
walls Gamma: each wall's node mean (``wall_mean``) weighted by the wall's measure (its length
in 2-D, area in 3-D). Only the blocks holding a wall add to its part, with no exchange;
they need 3 nodes along its normal. The data a, b, c, q: numbers, fields on the nodes (channels
of the inputs) or functions of the coordinates, evaluated on the wall. ``rim=False`` leaves
out the wall's nodes that lie on another wall (its edges and corners), e.g. those a Dirichlet
wall holds.

Example, -lap u = f with u = g(x, y) on three walls and du/dn = q on x = 1::

    def impose(self, u, inputs):
        return dirichlet(self, u, lambda y, x: np.sin(np.pi * x) + y,
                         walls=("x_lo", "y_lo", "y_hi"))

    def loss_terms(self, u, inputs):
        r = laplacian(u) + inputs[:, :1]
        return {"pde": self.mean(r.square(), interior=1),
                "bc": neumann(self, u, inputs[:, 1:2], walls="x_hi", rim=False)}
"""
from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import torch

from diffnet.domain import Block
from diffnet.problems.contract.blocks import (SIDES, block_coords, check_wall, cut, holds_wall,
                                              node_mean, wall_mean)


# -- coordinates and walls ------------------------------------------------------------------------
def mesh(problem, block: Block | None = None) -> list[np.ndarray]:
    """The node coordinates of ``block`` of ``problem``'s grid (default: the whole grid), one
    float64 array (*block.shape) per axis in grid order (``np.meshgrid(..., indexing="ij")`` of
    :func:`~.blocks.block_coords`): a field evaluated pointwise on them is the whole grid's field
    cut to the block, bit for bit."""
    return np.meshgrid(*block_coords(problem, block), indexing="ij")


def wall_names(problem) -> list[str]:
    """The names of ``problem``'s walls in order: ``["y_lo", "y_hi", "x_lo", "x_hi"]``."""
    return [f"{a.name}_{s}" for a in problem.axes for s in SIDES]


def walls_of(problem, walls=None) -> tuple[tuple[int, str], ...]:
    """``walls`` (None: all; a wall name; or a sequence of names or (axis, side) pairs) as
    distinct (axis index, side) pairs; ValueError listing the problem's walls otherwise."""
    names = wall_names(problem)
    if walls is None:
        return tuple((a, s) for a in range(len(problem.axes)) for s in SIDES)
    items = [walls] if isinstance(walls, str) else list(walls)
    out = []
    for w in items:
        if isinstance(w, str) and w in names:
            pair = divmod(names.index(w), 2)
            pair = (pair[0], SIDES[pair[1]])
        elif (isinstance(w, (tuple, list)) and len(w) == 2 and w[1] in SIDES
              and isinstance(w[0], int) and 0 <= w[0] < len(problem.axes)):
            pair = (w[0], w[1])
        else:
            raise ValueError(f"unknown wall {w!r}: the walls of problem {problem.name!r} are "
                             f"{names} (or (axis index, 'lo' | 'hi'))")
        if pair not in out:
            out.append(pair)
    if not out:
        raise ValueError(f"no walls given: name some of {names}, or None for all")
    return tuple(out)


def _unit(problem, block) -> list[np.ndarray]:
    """Per axis, the block's 1-D node coordinates mapped to [0, 1]."""
    return [(c - a.lo) / (a.hi - a.lo) for c, a in zip(block_coords(problem, block), problem.axes)]


def _along(v: np.ndarray, axis: int, dims: int) -> np.ndarray:
    """A 1-D array along ``axis`` of a ``dims``-axis grid, broadcastable over the others."""
    return v.reshape([-1 if a == axis else 1 for a in range(dims)])


# -- the bubble and the lift ----------------------------------------------------------------------
def bubble(problem, block: Block | None = None, walls=None) -> np.ndarray:
    """(*block.shape) float64 (default block: the whole grid): zero exactly on the chosen
    ``walls`` (default all), 1 at the centre; per axis 4 t (1 - t) with both walls chosen,
    t (2 - t) with the lo wall only, 1 - t^2 with the hi wall only, 1 with none. Read-only."""
    block = Block(problem.grid) if block is None else block
    chosen = walls_of(problem, walls)
    sides = tuple(tuple(s for s in SIDES if (a, s) in chosen) for a in range(block.dims))
    units = tuple(tuple(t.tolist()) for t in _unit(problem, block))
    return _bubble(units, sides)


@functools.lru_cache(maxsize=64)
def _bubble(units, sides) -> np.ndarray:
    """The bubble of per-axis unit coordinates ``units`` and chosen sides (cached: a lift
    recomputes it at every call of ``impose``)."""
    d = len(units)
    out = np.ones(tuple(len(t) for t in units))
    for a, (t, s) in enumerate(zip(units, sides)):
        t = np.asarray(t)
        f = {("lo", "hi"): 4 * t * (1 - t), ("lo",): t * (2 - t), ("hi",): (1 - t) * (1 + t),
             (): np.ones_like(t)}[s]
        out = out * _along(f, a, d)
    out.setflags(write=False)
    return out


def transfinite_lift(problem, g, block: Block | None = None, walls=None) -> np.ndarray:
    """(..., *block.shape) float64 (default block: the whole grid): a field equal to g on the
    chosen ``walls`` (default all), extended inside by transfinite (Coons) interpolation, the
    Boolean sum of the linear interpolations between each axis's walls (an axis with one wall
    chosen: the constant extension from it). In 2-D with every wall,
    G = sum_a P_a g - P_y P_x g, P_x g = (1 - t_x) g(x_lo, y) + t_x g(x_hi, y). Exactly g on
    those walls' nodes; pointwise, so the block's values are the whole grid's cut to it.

    ``g``: a function of the coordinates, called as ``g(*coords)`` with one float64 array per
    axis in grid order (``g(y, x)``), returning values broadcastable to the nodes, or (n, *nodes)
    for n draws; or an array (..., *grid) on the whole grid whose wall values are read."""
    block = Block(problem.grid) if block is None else block
    d = block.dims
    chosen = walls_of(problem, walls)
    units = _unit(problem, block)
    face = _face(problem, g, block)
    lift, axes = 0.0, [a for a in range(d) if any(w[0] == a for w in chosen)]
    for k in range(1, len(axes) + 1):
        for subset in itertools.combinations(axes, k):
            sign = 1.0 if k % 2 else -1.0
            for pick in itertools.product(*([s for s in SIDES if (a, s) in chosen]
                                            for a in subset)):
                weight = np.ones(())
                for a, s in zip(subset, pick):
                    if len([w for w in chosen if w[0] == a]) == 2:
                        t = units[a] if s == "hi" else 1 - units[a]
                        weight = weight * _along(t, a, d)
                lift = lift + sign * weight * face(dict(zip(subset, pick)))
    exact = face({})
    on_wall = np.zeros(block.shape, dtype=bool)
    for a, s in chosen:
        i = np.arange(block.start[a], block.start[a] + block.shape[a])
        on_wall = on_wall | _along(i == (0 if s == "lo" else block.grid[a] - 1), a, d)
    lift, exact = np.broadcast_arrays(lift, exact)
    return np.where(on_wall, exact, lift)


def _face(problem, g, block):
    """fixed -> the values of g at the block's nodes with coordinate a moved to wall side
    fixed[a] for each axis a in fixed: (..., *shape) float64, size 1 along the fixed axes."""
    d = block.dims
    if callable(g):
        coords = block_coords(problem, block)
        full = problem.coords()

        def at(fixed):
            # the wall's coordinate along each fixed axis, the block's nodes along the others
            vecs = [full[ax.name][[0 if fixed[a] == "lo" else -1]] if a in fixed else c
                    for a, (c, ax) in enumerate(zip(coords, problem.axes))]
            pts = np.meshgrid(*vecs, indexing="ij")
            return _values(g(*pts), pts[0].shape, "g(*coords)")
        return at
    arr = np.asarray(g.detach().cpu() if isinstance(g, torch.Tensor) else g, dtype=np.float64)
    if arr.ndim < d or arr.shape[arr.ndim - d:] != tuple(block.grid):
        raise ValueError(f"g must be a function of the coordinates or an array (..., "
                         f"*{list(block.grid)}) on the whole grid, got shape {arr.shape}")

    def at(fixed):
        v = arr
        for a in range(d):
            ax = arr.ndim - d + a
            if a in fixed:
                v = v.take([0 if fixed[a] == "lo" else block.grid[a] - 1], axis=ax)
            else:
                v = v.take(np.arange(block.start[a], block.start[a] + block.shape[a]), axis=ax)
        return v
    return at


def _values(v, shape, what) -> np.ndarray:
    """``v`` as float64 values on nodes of ``shape``: (*shape) or (..., *shape)."""
    v = np.asarray(v, dtype=np.float64)
    try:
        v = np.broadcast_to(v, np.broadcast_shapes(v.shape, tuple(shape)))
    except ValueError:
        raise ValueError(f"{what} must return values on the nodes, broadcastable to "
                         f"{tuple(shape)} (or (n, *nodes) for n draws), got shape "
                         f"{v.shape}") from None
    if v.shape[v.ndim - len(shape):] != tuple(shape):
        raise ValueError(f"{what} must return values on the nodes {tuple(shape)} (or (n, "
                         f"*nodes) for n draws), got shape {v.shape}")
    return v


def dirichlet(problem, u: torch.Tensor, g=0.0, *, scale: float = 1.0,
              walls=None) -> torch.Tensor:
    """u = G + scale * bubble * N on ``problem.block``: the network output ``u`` (B, K, *shape)
    with u = g imposed exactly on ``walls`` (default all); for ``impose``.

    ``g``: a number; a field on the nodes, G itself, equal to g on those walls (a channel of the
    inputs, ``inputs[:, 4:5]``, or an array (*grid), (n, *grid) or (n, 1, *grid) on the whole
    grid or on the block); or a function of the coordinates ``g(*coords)`` (the wall values:
    extended inside by :func:`transfinite_lift`, evaluated at every call, so a costly or
    draw-dependent g belongs in ``build_input`` as a lift channel). ``scale`` (> 0): the
    size of u - G that the network's output of size 1 stands for."""
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a number > 0 (the size of u - G), got {scale!r}")
    block = problem.block
    w = _tensor(scale * bubble(problem, block, walls), u)
    if callable(g):
        lift = _tensor(transfinite_lift(problem, g, block, walls), u)
        lift = lift.reshape(-1, 1, *block.shape) if lift.dim() > block.dims else lift
    else:
        lift = field_on_block(problem, g, u, "g")
    return lift + w * u


def _tensor(v, like: torch.Tensor) -> torch.Tensor:
    """A tensor or an array (a copy of a read-only one: broadcast views, the cached bubble) in
    the dtype and device of ``like``."""
    if isinstance(v, torch.Tensor):
        return v.to(dtype=like.dtype, device=like.device)
    return torch.tensor(np.asarray(v), dtype=like.dtype, device=like.device)


def field_on_block(problem, value, like: torch.Tensor, what: str = "value") -> torch.Tensor:
    """``value`` on the nodes of ``problem.block`` in the dtype and device of ``like``: a
    number (a 0-d tensor); a field (*grid), (n, *grid) or (n, C, *grid), on the whole grid (cut
    to the block) or already on the block (a channel of the inputs), as (n, C, *shape); or a
    function of the coordinates, evaluated on the block's nodes."""
    block = problem.block
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return like.new_tensor(float(value))
    if callable(value):
        value = _values(value(*mesh(problem, block)), block.shape, f"{what}(*coords)")
    t = _tensor(value, like)
    d = block.dims
    if t.dim() == 0:
        return t
    if t.dim() in (d, d + 1):
        t = t.reshape(-1, 1, *t.shape[t.dim() - d:])
    if t.dim() != d + 2 or tuple(t.shape[2:]) not in (block.shape, block.grid):
        raise ValueError(f"{what} must be a number, a function of the coordinates or a field "
                         f"(*grid), (n, *grid) or (n, C, *grid) on grid {list(block.grid)} or "
                         f"on the block {list(block.shape)}, got shape {tuple(t.shape)}")
    return t if tuple(t.shape[2:]) == block.shape else cut(block, t)


# -- Neumann and Robin conditions -----------------------------------------------------------------
def normal_derivative(problem, u: torch.Tensor, axis: int, side: str) -> torch.Tensor:
    """(B, C, *shape with 1 along ``axis``) the outward normal derivative du/dn of u
    (B, C, *shape) on the wall of ``axis`` on ``side``, on ``problem.block`` (which must hold
    that wall), by the one-sided second-order difference (3 u_0 - 4 u_1 + u_2) / (2 h), u_0 on
    the wall: exact on quadratics along the normal. No exchange: the block's own nodes."""
    block = problem.block
    _check_normal(block, axis, side)
    if not holds_wall(block, axis, side):
        raise ValueError(f"{block!r} does not hold the wall of axis {axis} on side {side!r}: "
                         f"ask only a block that holds it (block.at_lo(axis) / at_hi(axis))")
    dim, n = u.dim() - block.dims + axis, u.shape[u.dim() - block.dims + axis]
    node = (lambda k: u.narrow(dim, k, 1)) if side == "lo" else (
        lambda k: u.narrow(dim, n - 1 - k, 1))
    return (3 * node(0) - 4 * node(1) + node(2)) / (2 * problem.spacing[axis])


def _check_normal(block, axis, side) -> None:
    check_wall(block, axis, side)
    if block.shape[axis] < 3:
        raise ValueError(f"a normal derivative on a wall of axis {axis} needs 3 nodes along it "
                         f"on the blocks that hold the wall, but the blocks of {block!r} have "
                         f"{block.shape[axis]}: split axis {axis} into fewer blocks")


def robin(problem, u: torch.Tensor, a, b, c=0.0, *, walls=None, rim: bool = True) -> torch.Tensor:
    """(B,) the boundary mean of r^2, r = a u + b du/dn - c, over the chosen ``walls`` (default
    all): each wall's node mean weighted by the wall's share of their total measure (module
    docstring); on a split block, its part (only blocks holding a wall add to it).

    ``a``, ``b``, ``c``: each a number, a field on the nodes (a channel of the inputs; only its
    wall values are read) or a function of the coordinates ``f(*coords)`` (evaluated on the
    walls). ``rim=False``: leave out the nodes a wall shares with another wall (edges,
    corners)."""
    block = problem.block
    chosen = walls_of(problem, walls)
    spans = [ax.hi - ax.lo for ax in problem.axes]
    measure = [math.prod(s for k, s in enumerate(spans) if k != axis) for axis, _ in chosen]
    out = u.new_zeros(u.shape[0])
    for (axis, side), m in zip(chosen, measure):
        _check_normal(block, axis, side)
        if not holds_wall(block, axis, side):
            continue        # the blocks that hold the wall count it, with no exchange
        dim = u.dim() - block.dims + axis
        on_wall = u.narrow(dim, 0 if side == "lo" else u.shape[dim] - 1, 1)
        r = _on_wall(problem, b, u, axis, side, "b") * normal_derivative(problem, u, axis, side)
        if not (isinstance(a, (int, float)) and a == 0):
            r = _on_wall(problem, a, u, axis, side, "a") * on_wall + r
        r = r - _on_wall(problem, c, u, axis, side, "c")
        out = out + (m / sum(measure)) * _wall_part(block, r.square(), axis, side, rim)
    return out


def neumann(problem, u: torch.Tensor, q=0.0, *, walls=None, rim: bool = True) -> torch.Tensor:
    """(B,) the boundary mean of (du/dn - q)^2 over the chosen ``walls``: :func:`robin` with
    a = 0, b = 1, c = q (the same data forms)."""
    return robin(problem, u, 0.0, 1.0, q, walls=walls, rim=rim)


def _on_wall(problem, value, like, axis, side, what) -> torch.Tensor:
    """``value`` at the nodes of the wall, broadcastable to (B, C, *shape with 1 along axis)."""
    block = problem.block
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return like.new_tensor(float(value))
    if callable(value):
        coords, full = block_coords(problem, block), problem.coords()
        name = problem.axes[axis].name
        coords[axis] = full[name][[0 if side == "lo" else -1]]
        pts = np.meshgrid(*coords, indexing="ij")
        v = _values(value(*pts), pts[0].shape, f"{what}(*coords)")
        return _tensor(v, like).reshape(-1, 1, *pts[0].shape)
    t = field_on_block(problem, value, like, what)
    dim = t.dim() - block.dims + axis
    if t.shape[dim] == 1:
        return t
    return t.narrow(dim, 0 if side == "lo" else t.shape[dim] - 1, 1)


def _wall_part(block, t: torch.Tensor, axis: int, side: str, rim: bool) -> torch.Tensor:
    """(B,) this block's part of the mean of the wall field t (B, ..., *shape with 1 along
    ``axis``) over the wall's nodes (``rim=False``: those not on another wall)."""
    if rim:
        return wall_mean(block, t, axis, side)
    lead = t.dim() - block.dims
    keep = [k for k in range(block.dims) if k != axis]
    face = Block([block.grid[k] for k in keep], [block.start[k] for k in keep],
                 [block.shape[k] for k in keep])      # the wall's geometry: node_mean needs no exchange
    return node_mean(face, t.squeeze(lead + axis), interior=1)
