"""The multilevel (BPX-type) norm of a PDE residual: a well-conditioned replacement for the
mean square of a strong-form residual, exact on a split grid.

Why: the squared residual ``mean(r^2)`` of a second-order operator A is the quadratic form
A^T A, whose condition number grows like h^-4: gradient descent fits the rough part of the
error and leaves the smooth part. Measured in an H^-1-like norm, ||A u||_B^2 is equivalent to
the energy norm u^T A u (B ~ A^-1 spectrally, the BPX preconditioner of Bramble, Pasciak and
Xu), so the loss is conditioned like an energy (h^-2), with no energy to write.

The norm, on a grid of d axes with spacing h_a, levels l = 0 .. L, cell side m_l = 2^l nodes::

    ||r||_B^2 = sum_l w_l s_l |c_l| sum_J rbar_{l,J}^2,
    s_l = 1 / sum_a (m_l h_a)^-2        (the cell size squared: (m_l h)^2 / d on a cube grid)
    |c_l| = m_l^d prod_a h_a            (the volume of a level-l cell)
    rbar_{l,J} = m_l^-d sum_i phi_{l,J}(i) r_i
    phi_{l,J}(i) = prod_a max(0, 1 - |i_a - m_l J_a| / m_l)

rbar_{l,J} is the tent-weighted mean of r around the level-l node m_l J (the restriction of
multigrid's full weighting), over the coarse nodes strictly inside the grid (0 < m_l J_a <
n_a - 1: the coarse spaces vanish on the boundary, as H^-1 = (H^1_0)' asks). So each level is
s_l times the integral of the level's smooth part of r squared, and level 0 is s_0 times the
integral of r^2 (rbar_0 = r, every node counted). Residual nodes fewer than ``interior`` nodes
from the boundary count as zero (their equations are boundary conditions, a term of their own).
Plain cell means instead of tents are not enough: a residual that changes sign across a cell
face has mean values of size h / h_l there while its H^-1 norm is far smaller, and the
conditioning then grows like h^-3 (``tests/test_residual_norm.py`` measures both).

Which loss when: an energy (``self.edges``, docs/your-own-pde.md) when the PDE has one; this
norm of the strong residual when it has none (advection, a non-symmetric operator, a
residual you already have); the plain ``self.mean(r.square(), interior=1)`` when the operator
is first order or zero order (no h^-2 to undo) or when the rough error is what matters.

Split grid: a level whose cells fit the block (its start and shape multiples of m_l, the grid
too) sums its cells on the block and takes the neighbouring cells' partial sums through one
halo of the coarse block (``block.at_shape``); a level whose cells straddle blocks sums every
block's partial cell sums over the split (``block.sum``, a (B, 2^d, *cells) tensor, small at the
coarse levels where it happens) and returns the block's ``share``. Either way the parts summed
over the blocks are the undivided value and gradient, with no condition on the split.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from diffnet.problems.contract.blocks import block_and_spacing, interior_mask, share
from diffnet.problems.contract.cells import summed_over_split


def max_levels(grid) -> int:
    """The number of levels with a coarse node inside the grid: cell sides 1, 2, 4, ... up to
    the largest power of two <= min(grid) - 2."""
    least = min(int(n) for n in grid)
    if least < 3:
        raise ValueError(f"a multilevel residual norm needs >= 3 nodes per axis, got grid "
                         f"{list(grid)}")
    return (least - 2).bit_length()


def residual_norm(r: torch.Tensor, where, *, spacing=None, levels: int | None = None,
                  weights=None, interior=1, coefficient=None, reaction=None,
                  advection=None) -> torch.Tensor:
    """(B,) the multilevel norm squared ||r||_B^2 of a residual r (module docstring: formula,
    when to use it); on a split block, this block's part (the parts sum to the undivided value).

    Args:
        r: the residual at the nodes, (B, *shape) or (B, C, *shape) (channels summed), on the
            block of ``where``.
        where: a problem (its ``block`` and ``spacing`` are used), or a ``Block``.
        spacing: the node spacing per axis; needed with a Block, default the problem's.
        levels: how many levels, cell sides 1, 2, ..., 2^(levels - 1) nodes (default: all,
            ``max_levels(grid)``).
        weights: w_l per level (default all 1), non-negative.
        interior: residual nodes closer than this to the boundary (an int, or one per axis)
            count as zero.
        coefficient: the operator's diffusion coefficient a > 0 at the nodes of the block,
            broadcastable to r, for -div(a grad u) + ...: r is measured as r / sqrt(a). Where a
            is smooth, A^-1 ~ a^-1/2 (-Laplacian)^-1 a^-1/2, so the norm stays equivalent to
            the energy however far a swings; without it a region of large a weighs a times
            too much and one of small a too little.
        reaction: the zero-order coefficient c of -div(a grad u) + c u, relative to a (c / a,
            or c without ``coefficient``): a number >= 0 or one per sample (B,). Level l then
            weighs 1 / (c + sum_a (m_l h_a)^-2) instead of s_l: where c outweighs the level's
            1 / size^2 the operator is c times the identity there, and its inverse c^-1, not
            the cell size squared.
        advection: the speed |b| of a first-order term b . grad u, relative to a as
            ``reaction`` is: a number >= 0 or one per sample (B,). Level l then weighs
            1 / (c + |b| k_l + k_l^2), k_l^2 = sum_a (m_l h_a)^-2: the size of the operator's
            symbol at the level's scale, so the levels coarser than the cell Peclet number's
            a / |b| weigh as a first-order operator's inverse does.

    Example, the residual of the 5-point Laplacian on a 33 x 33 grid, as a problem's loss
    would write ``pde = residual_norm(r, self)``:

    >>> import torch
    >>> from diffnet.domain import Block
    >>> from diffnet.problems import residual_norm
    >>> from diffnet.stencils import FiniteDifference
    >>> h = 1 / 32
    >>> u = torch.rand(2, 1, 33, 33, dtype=torch.float64)
    >>> d = FiniteDifference((h, h), "central", derivatives=("rr", "cc"))(u)
    >>> r = d[:, 0] + d[:, 1] - 1.0                              # u_yy + u_xx - f
    >>> n2 = residual_norm(r, Block((33, 33)), spacing=(h, h))
    >>> n2.shape, bool((n2 > 0).all())
    (torch.Size([2]), True)
    >>> torch.allclose(residual_norm(3 * r, Block((33, 33)), spacing=(h, h)), 9 * n2)
    True
    """
    block, spacing = block_and_spacing(where, spacing, "residual_norm")
    d = block.dims
    if r.dim() == d + 1:
        r = r.unsqueeze(1)
    if r.dim() != d + 2 or tuple(r.shape[2:]) != block.shape:
        raise ValueError(f"r must be the residual on the block, (B, *{list(block.shape)}) or "
                         f"(B, C, *{list(block.shape)}), got {tuple(r.shape)}")
    if coefficient is not None:
        r = r * torch.rsqrt(_coefficient(coefficient, r))
    b, c = r.shape[:2]
    r = r.reshape(b * c, 1, *block.shape) * interior_mask(block, interior, r)
    levels, weights = _levels(block.grid, levels, weights)
    vol = math.prod(spacing)
    react = _per_sample("reaction", reaction, b, r).repeat_interleave(c)
    speed = _per_sample("advection", advection, b, r).repeat_interleave(c)
    out = r.new_zeros(b * c)
    for lev, w in enumerate(weights):
        if w == 0:
            continue
        m = 2 ** lev
        k2 = sum((m * h) ** -2 for h in spacing)
        s = 1.0 / (react + speed * math.sqrt(k2) + k2)
        out = out + (w * vol / m ** d) * s * _level(r, block, m)
    return out.view(b, c).sum(1)



def _coefficient(a, r) -> torch.Tensor:
    """``a`` as a tensor like r, checked positive and broadcastable to r (B, C, *shape)."""
    a = torch.as_tensor(a, dtype=r.dtype, device=r.device)
    try:
        torch.broadcast_shapes(a.shape, r.shape)
    except RuntimeError:
        raise ValueError(f"coefficient must be broadcastable to the residual {tuple(r.shape)} "
                         f"(the coefficient at the block's nodes, e.g. (B, 1, *shape)), got "
                         f"{tuple(a.shape)}") from None
    if not bool((a > 0).all()):
        raise ValueError("coefficient must be positive at every node (it is the diffusion "
                         "coefficient a of -div(a grad u)); pass exp(log_a) or clamp it")
    return a


def _per_sample(name: str, c, b: int, like) -> torch.Tensor:
    """(B,) a coefficient (reaction, advection) per sample, from None, a number or a (B,)
    tensor, >= 0."""
    c = torch.as_tensor(0.0 if c is None else c, dtype=like.dtype, device=like.device)
    if c.dim() > 1 or c.numel() not in (1, b):
        raise ValueError(f"{name} must be a number or one per sample ({b},), got shape "
                         f"{tuple(c.shape)}")
    if not bool((c >= 0).all()):
        raise ValueError(f"{name} must be >= 0 (a coefficient of -div(a grad u) + b . grad u "
                         f"+ c u relative to a: c for reaction, |b| for advection)")
    return c.reshape(-1).expand(b)


def _levels(grid, levels, weights) -> tuple[int, list[float]]:
    """(levels, weights) checked against the grid."""
    most = max_levels(grid)
    if levels is None:
        levels = most if weights is None else len(weights)
    if not isinstance(levels, int) or not 1 <= levels <= most:
        raise ValueError(f"levels must be an integer in 1..{most} on grid {list(grid)} (cell "
                         f"sides up to {2 ** (most - 1)} nodes), got {levels!r}")
    weights = [1.0] * levels if weights is None else [float(w) for w in weights]
    if len(weights) != levels or any(not w >= 0 for w in weights):
        raise ValueError(f"weights must give one non-negative weight per level ({levels}), "
                         f"got {weights!r}")
    return levels, weights



def _level(r: torch.Tensor, block, m: int) -> torch.Tensor:
    """(N,) sum over this block's interior level-m coarse nodes of (sum_i phi_J(i) r_i)^2; the
    block's share when the level's cells straddle blocks."""
    if m == 1:
        return r.square().sum(tuple(range(1, r.dim())))
    d = block.dims
    if block.whole:
        return _tent_squares(F.pad(_moments(r, m, (0,) * d), [1, 1] * d), block.grid, m,
                             (0,) * d)
    if all(s % m == 0 and n % m == 0 and g % m == 0
           for s, n, g in zip(block.start, block.shape, block.grid)):
        cells = tuple(n // m for n in block.shape)
        p = block.at_shape(cells).halo(_moments(r, m, (0,) * d), 1)
        return _tent_squares(p, block.grid, m, tuple(s // m for s in block.start))
    # cells straddle blocks: every block's partial cell sums, summed over the split
    part = _moments(r, m, tuple(s % m for s in block.start))
    whole = summed_over_split(block, part, (m,) * d)
    value = _tent_squares(F.pad(whole, [1, 1] * d), block.grid, m, (0,) * d)
    return share(block, value)


def _moments(r: torch.Tensor, m: int, lead) -> torch.Tensor:
    """(N, 2^d, *cells) the tent moments of the cells of side m that r (N, 1, *shape) covers,
    its first node ``lead[a]`` nodes into its first cell along axis a. Channel bit a set: the
    weight k / m of the cell's node k along axis a (its part of the tent at the cell's far
    end); unset: 1 - k / m (the tent at the cell's first node)."""
    t = r
    for a in range(r.dim() - 2):
        dim, n = 2 + a, t.shape[2 + a]
        cells = -(-(lead[a] + n) // m)
        pad = [0, 0] * (r.dim() - 3 - a) + [lead[a], cells * m - lead[a] - n]
        t = F.pad(t, pad).unflatten(dim, (cells, m))
        k = torch.arange(m, dtype=t.dtype, device=t.device) / m
        far = (t * k.view((m,) + (1,) * (t.dim() - dim - 2))).sum(dim + 1)
        t = torch.cat([t.sum(dim + 1) - far, far], dim=1)
    return t


def _tent_squares(p: torch.Tensor, grid, m: int, first) -> torch.Tensor:
    """(N,) sum of the squared tent sums over the interior coarse nodes, from the moments ``p``
    (N, 2^d, *cells + 2) padded by one cell each side (ghost cells: the neighbours' moments or
    zeros); coarse node J of the cells is the first node of cell J, global index first + J."""
    d = len(grid)
    cells = [n - 2 for n in p.shape[2:]]
    tent = 0
    for c in range(2 ** d):
        q = p[:, c]
        for a in range(d):
            far = (c >> a) & 1          # the tent at J gathers the far end of cell J - 1
            q = q.narrow(1 + a, 1 - far, cells[a])
        tent = tent + q
    mask = tent.new_ones(())
    for a in range(d):
        j = torch.arange(first[a], first[a] + cells[a], device=p.device)
        mask = mask.unsqueeze(-1) * ((j >= 1) & (j * m <= grid[a] - 2)).to(tent.dtype)
    return (tent.square() * mask).sum(tuple(range(1, tent.dim())))
