"""A symmetric geometric-algebraic multigrid V-cycle for a radius-1 stencil on a node grid: the
preconditioner B of :func:`~diffnet.problems.contract.operator_norm.operator_norm` (see its
module docstring for the choices and why), and the stencils it is built from.

Stencils are (B, 3^d, *grid) coefficients A[i, i + o], found from a linear operator by
probing it with 3^d colour fields (``probe``). Levels coarsen every axis by 2: the coarse nodes
are the even fine nodes and, on an even side, the last node too (n // 2 + 1 nodes, the last
coarse gap one fine spacing: both boundary nodes stay on every level, which a Neumann wall
needs; an even side becomes odd after one level). P is linear interpolation along each axis,
R = P^T (full weighting), coarse operators Galerkin (A_c = P^T A P, probed). The smoother is
l1-Jacobi; the coarsest level is solved by a dense Cholesky per sample. Everything works on
the whole grid, batched over samples (B, 1, *grid).
"""
from __future__ import annotations

import math

import torch

# -- stencils: (B, 3^d, *grid) coefficients, offset o in {-1, 0, 1}^d at index sum (o_a+1) 3^a

def offsets(d: int) -> list[tuple]:
    """The 3^d offsets of a radius-1 stencil, in the order of its coefficient channels."""
    out = [()]
    for _ in range(d):
        out = [o + (k,) for k in (-1, 0, 1) for o in out]
    return [tuple(reversed(o)) for o in out]


def shifted(x: torch.Tensor, o) -> torch.Tensor:
    """y[i] = x[i + o] (zero beyond the grid), x (B, C, *grid)."""
    for a, k in enumerate(o):
        if k == 0:
            continue
        dim, n = 2 + a, x.shape[2 + a]
        pad = torch.zeros_like(x.narrow(dim, 0, 1))
        x = (torch.cat([x.narrow(dim, 1, n - 1), pad], dim) if k > 0
             else torch.cat([pad, x.narrow(dim, 0, n - 1)], dim))
    return x


def stencil_apply(s: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A x for the stencil s (B, 3^d, *grid) and x (B, 1, *grid)."""
    out = 0
    for c, o in enumerate(offsets(x.dim() - 2)):
        out = out + s[:, c:c + 1] * shifted(x, o)
    return out


def probe(apply, like: torch.Tensor, start=None, grid=None) -> torch.Tensor:
    """(B, 3^d, *shape) the radius-1 stencil of the linear ``apply`` from 3^d calls on colour
    fields shaped like ``like`` (B, 1, *shape): (A v_c)[i] = A[i, i + o] for the one offset o
    with i + o of colour c (i_a mod 3). The field is the nodes ``start`` .. ``start + shape`` of
    ``grid`` (default: the whole grid), colours and the grid's edges by global index, so a
    block's probes are the cut of the whole grid's."""
    b, _, *shape = like.shape
    start = (0,) * len(shape) if start is None else tuple(start)
    grid = tuple(shape) if grid is None else tuple(grid)
    idx = [s + torch.arange(n, device=like.device) for s, n in zip(start, shape)]
    lines = lambda test: [test(a, i).to(like.dtype) for a, i in enumerate(idx)]  # noqa: E731
    outs = {c: apply(_outer(like, lines(lambda a, i: i % 3 == c[a] + 1))
                     .expand(b, 1, *shape).contiguous())
            for c in offsets(len(shape))}           # colour c_a + 1 in {0, 1, 2}
    coeff = []
    for o in offsets(len(shape)):
        s = sum(out * _outer(like, lines(lambda a, i: (i + o[a]) % 3 == c[a] + 1))
                for c, out in outs.items())
        inside = lines(lambda a, i: (i + o[a] >= 0) & (i + o[a] < grid[a]))
        coeff.append(s * _outer(like, inside))      # no coupling beyond the grid
    return torch.cat(coeff, dim=1)


def _outer(like, lines) -> torch.Tensor:
    """The outer product of 1-D ``lines``, one per axis: (*shape)."""
    out = like.new_ones(())
    for line in lines:
        out = out.unsqueeze(-1) * line
    return out


#: the most nodes of the coarsest level, solved by a dense Cholesky
COARSEST = 512
NOT_DEFINITE = ("operator_norm needs a positive definite operator (an energy's gradient with "
                "Dirichlet nodes or a reaction term): this one is not (a pure Neumann problem "
                "has the constants in its kernel: pass interior= for its Dirichlet nodes)")


def coarse_shape(grid) -> tuple:
    """The next level's nodes per axis: the even fine nodes, and the last one if it is odd
    (n // 2 + 1), so that every level keeps both boundary nodes."""
    return tuple(n // 2 + 1 for n in grid)


def default_levels(grid) -> int:
    """Levels down to at most COARSEST nodes, no side below 3."""
    levels = 1
    while math.prod(grid) > COARSEST and min(coarse_shape(grid)) >= 3:
        grid = coarse_shape(grid)
        levels += 1
    return levels


def _ends(n: int, like) -> tuple:
    """Per fine node i of an axis of n nodes, its two coarse neighbours i // 2 and (i + 1) // 2
    (the same one for an even i, and for the last node of an even side, itself coarse)."""
    i = torch.arange(n, device=like.device)
    lo, hi = i // 2, (i + 1) // 2
    if n % 2 == 0:
        lo[-1] = hi[-1] = n // 2
    return lo, hi


def prolong(c: torch.Tensor, grid) -> torch.Tensor:
    """(B, 1, *grid) linear interpolation P c of the coarse field c (B, 1, *coarse_shape(grid))
    along every axis (bilinear in 2-D)."""
    for a, n in enumerate(grid):
        lo, hi = _ends(n, c)
        c = 0.5 * (c.index_select(2 + a, lo) + c.index_select(2 + a, hi))
    return c


def restrict(f: torch.Tensor, grid) -> torch.Tensor:
    """(B, 1, *coarse_shape(grid)) P^T f of f (B, 1, *grid): full weighting, unscaled."""
    for a, (n, nc) in enumerate(zip(grid, coarse_shape(grid))):
        lo, hi = _ends(n, f)
        shape = list(f.shape)
        shape[2 + a] = nc
        half = 0.5 * f
        f = f.new_zeros(shape).index_add(2 + a, lo, half).index_add(2 + a, hi, half)
    return f


class Level:
    """One level: its grid, stencil (B, 3^d, *grid) and l1 diagonal (B, 1, *grid)."""

    def __init__(self, grid, stencil):
        self.grid = tuple(grid)
        self.stencil = stencil
        l1 = stencil.abs().sum(1, keepdim=True)
        self.inv_l1 = torch.where(l1 > 0, 1 / l1.clamp_min(torch.finfo(l1.dtype).tiny), 0)

    def apply(self, x):
        return stencil_apply(self.stencil, x)


def build_hierarchy(stencil: torch.Tensor, levels=None):
    """([Level], coarsest Cholesky factor) from the finest level's stencil (B, 3^d, *grid):
    ``levels`` levels (default ``default_levels``), Galerkin coarse stencils by probing."""
    grid = tuple(stencil.shape[2:])
    most = default_levels(grid) if levels is None else levels
    if (not isinstance(most, int) or isinstance(most, bool) or most < 1
            or not _coarsens(grid, most)):
        raise ValueError(f"levels must be an integer >= 1 whose coarsest grid keeps >= 3 nodes "
                         f"per axis (grid {list(grid)}: at most {_most(grid)}), got {levels!r}")
    l1 = stencil.abs().sum(1).flatten(1).amax(1)
    kernel = stencil.sum(1).abs().flatten(1).amax(1) <= 64 * torch.finfo(stencil.dtype).eps * l1
    if bool(kernel.any()):         # A 1 = 0: the constants are in the kernel (pure Neumann)
        raise ValueError(NOT_DEFINITE)
    out = [Level(grid, stencil)]
    for _ in range(most - 1):
        fine = out[-1]
        c = coarse_shape(fine.grid)
        galerkin = lambda v, f=fine: restrict(f.apply(prolong(v, f.grid)), f.grid)  # noqa: E731
        out.append(Level(c, probe(galerkin, stencil.new_zeros(stencil.shape[0], 1, *c))))
    return out, _coarsest_factor(out[-1])


def _coarsens(grid, levels) -> bool:
    for _ in range(levels - 1):
        grid = coarse_shape(grid)
        if min(grid) < 3:
            return False
    return True


def _most(grid) -> int:
    k = 1
    while _coarsens(grid, k + 1):
        k += 1
    return k


def _coarsest_factor(level) -> torch.Tensor:
    """(B, N, N) the Cholesky factor of the coarsest level's matrix (an all-zero row, a node
    with no unknown, gets a 1 on the diagonal: its right-hand side is zero)."""
    n = math.prod(level.grid)
    if n > 4 * COARSEST:
        raise ValueError(f"the coarsest level has {n} nodes ({list(level.grid)}), too many for "
                         f"its dense solve (at most {4 * COARSEST}): pass more levels")
    s = level.stencil
    units = torch.eye(n, dtype=s.dtype, device=s.device).reshape(n, 1, *level.grid)
    mat = torch.stack([stencil_apply(s[i:i + 1].expand(n, *s.shape[1:]), units).reshape(n, n)
                       for i in range(s.shape[0])]).transpose(1, 2)    # (B, N, N): A[i, j]
    empty = (mat.abs().sum(2) == 0)
    mat = mat + torch.diag_embed(empty.to(mat.dtype))
    factor, info = torch.linalg.cholesky_ex(0.5 * (mat + mat.transpose(1, 2)))
    if bool((info != 0).any()):
        raise ValueError(NOT_DEFINITE)
    return factor


def _smooth(level, x, b, sweeps):
    for _ in range(sweeps):
        x = x + level.inv_l1 * (b - level.apply(x))
    return x


def vcycle(hierarchy, b: torch.Tensor, smoothing: int, k: int = 0, x=None) -> torch.Tensor:
    """One symmetric V-cycle for A x = b from x (zero if None) on level k."""
    levels, factor = hierarchy
    level = levels[k]
    if k == len(levels) - 1:
        rhs = b.reshape(b.shape[0], -1, 1)
        if x is not None:
            rhs = rhs - level.apply(x).reshape(rhs.shape)
        y = torch.cholesky_solve(rhs, factor).reshape(b.shape)
        return y if x is None else x + y
    x = _smooth(level, torch.zeros_like(b) if x is None else x, b, smoothing)
    rc = restrict(b - level.apply(x), level.grid)
    x = x + prolong(vcycle(hierarchy, rc, smoothing, k + 1), level.grid)
    return _smooth(level, x, b, smoothing)


def vcycles(hierarchy, b: torch.Tensor, smoothing: int, cycles: int) -> torch.Tensor:
    """z = B b: ``cycles`` V-cycles from zero (a symmetric positive definite B)."""
    x = None
    for _ in range(cycles):
        x = vcycle(hierarchy, b, smoothing, 0, x)
    return x
