"""The operator-preconditioned norm of a residual: r^T B r with B a symmetric multigrid V-cycle
of the problem's OWN linear operator, so that ||A e||_B^2 ~ e^T A e (the energy norm of the
error) for any coefficient, however far it swings.

Why: :func:`~diffnet.problems.residual_norm` measures r in the Laplacian's BPX norm scaled
pointwise by 1 / sqrt(a); equivalent to the energy only where a is smooth on every level's
cells. A V-cycle built from A itself (Galerkin coarse operators) sees the coefficient at every
scale, so with its error propagation E (A-self-adjoint, 0 <= E <= rho < 1 in the A-inner
product) and B = (I - E^cycles) A^-1::

    (1 - rho^cycles) e^T A e  <=  (A e)^T B (A e)  <=  e^T A e

(``tests/test_operator_norm.py`` measures the band: fixed over grids for a smooth a; at four
decades of contrast it widens slowly with the number of levels, since linear P does not
follow the coefficient, where residual_norm's spread grows a hundredfold; ``cycles=2``
squares rho).
The value returned is the integral form, ``vol * r^T B r`` with vol the cell volume prod(h):
with r the pointwise (strong-form) residual and ``apply`` its linear part L, A = vol L is the
stiffness matrix and the value is about e^T A e = twice the energy error, with gradient about
twice the energy's (exactly so if the V-cycle were exact).

Design, and why:

* Stencils assembled by probing, once per call: the operator depends on the inputs only (never
  on the network), so ``apply`` is called 3^d times on colour fields (nodes with i_a = c_a mod
  3), which recovers a radius-1 stencil (3^d coefficients per node) exactly; one more call on a
  random field checks the stencil reproduces ``apply`` (a wider or a non-linear operator is
  refused, not silently mis-measured) and the stencil is checked symmetric (B needs a
  symmetric A; a non-symmetric operator is refused: residual_norm(advection=...)).
* Coarse operators are Galerkin, A_c = P^T A P, probed the same way on the coarse grid (3^d
  applications of the finer level's stencil): the coarse stencil of a radius-1 stencil under
  bilinear P is radius 1 again. P is linear interpolation along each axis from the coarse
  nodes (the even fine nodes, and the last node of an even side: both boundary nodes stay on
  every level, so a zero-flux wall's smooth error is on the coarse spaces; with a truncated
  tent at an even side's end instead, the V-cycle barely reduces such an error), R = P^T full
  weighting: the tents of residual_norm, one factor 2 at a time.
* The smoother is l1-Jacobi, x += D_1^-1 (b - A x), D_1 = the row sums of |A| (a damped Jacobi
  with a damping per node from the stencil, no parameter to tune): it converges in the
  A-norm for any SPD A (Gershgorin), so the symmetric V-cycle (``smoothing`` sweeps before and
  after each coarse correction, the same diagonal both ways) gives an SPD B with the band
  above. A damped Jacobi with a fixed 2/3 is not safe on Galerkin operators whose off-diagonal
  entries change sign under strong contrast.
* The coarsest level (at most ``COARSEST`` nodes) is solved exactly, by a dense Cholesky per
  sample: B's coarse part is then exactly A_c^-1.
* Gradient: B does not depend on u, so z = B r is computed without an autograd graph, and the
  loss is written vol (2 r . z - (r . z).detach()): value vol r . z, gradient 2 vol z = the
  gradient of vol r^T B r (B symmetric); the test checks it against autograd through B.

Split grid: each block probes ``apply`` on its own nodes (colours by global index), and the
stencil and the residual are gathered whole on every block (``block.gather_whole``); every
block then runs the same V-cycle on the whole grid and keeps z on its own nodes. The value
vol r . z and the gradient 2 vol z on the block's nodes sum over the blocks to the undivided
ones (the V-cycle's levels need not fit the blocks); the cost is the whole grid's V-cycle on
every block and two gathers of the grid per call.

Nodes closer than ``interior`` to the boundary are not unknowns (Dirichlet nodes): r and A are
masked there (A becomes M A M, M the mask), and they count as zero.

Which norm when: the energy (``self.edges``) when the PDE has one, or the energy of a symmetric
residual (:func:`~diffnet.problems.residual_energy`, no V-cycle); this norm when the residual
comes from a symmetric positive operator (an energy's gradient, -div(a grad u) + c u with any a
and c >= 0) and the grid is whole: it is the energy up to the V-cycle's band; residual_norm
when the operator is not symmetric (advection) or ``apply`` is not at hand, or when a split
grid is too large for every block to hold it whole (this norm gathers it, below).
"""
from __future__ import annotations

import math

import torch

from diffnet.problems.contract.blocks import block_and_spacing, interior_mask, one_field_shape
from diffnet.problems.contract.multigrid import (build_hierarchy, offsets, probe, shifted,
                                                 stencil_apply, vcycles)


def operator_norm(r: torch.Tensor, where, apply, *, spacing=None, levels: int | None = None,
                  smoothing: int = 2, cycles: int = 1, interior=1,
                  check: bool = True) -> torch.Tensor:
    """(B,) vol * r^T B r, B a symmetric V-cycle of the linear operator ``apply`` (module
    docstring: the formula, the design, when to use it), differentiable in r; on a split
    block, this block's part (the parts sum to the undivided value).

    Args:
        r: the residual at the nodes, (B, *shape) or (B, 1, *shape), on the block of
            ``where``.
        where: a problem (its ``block`` and ``spacing`` are used), or a ``Block``.
        apply: v -> A v, the residual's linear part, for v (B, 1, *shape) on the block
            (e.g. ``lambda v: residual(v) - residual(0)``); symmetric, radius 1 (each node
            couples to its 3^d neighbours at most), the same operator for every call (it may
            differ per sample).
        spacing: the node spacing per axis; needed with a Block, default the problem's.
        levels: how many levels including the finest (default: coarsen by 2 until at most
            ``COARSEST`` nodes remain or a side would fall below 3).
        smoothing: l1-Jacobi sweeps before and after each coarse correction, >= 1.
        cycles: V-cycles, >= 1 (B = (I - E^cycles) A^-1: closer to A^-1 with more).
        interior: nodes closer than this to the boundary (an int, or one per axis) are not
            unknowns (Dirichlet nodes): they count as zero and A is restricted to the rest.
        check: verify the probed stencil against ``apply`` on a random field and its symmetry
            (one more ``apply``); ValueError when either fails.

    Example, the five-point -Laplacian on a 33 x 33 grid, u = 0 on its boundary nodes: the
    residual of an error e is A e, and its norm is within the V-cycle's band of e^T A e:

    >>> import torch, torch.nn.functional as F
    >>> from diffnet.domain import Block
    >>> from diffnet.problems import operator_norm
    >>> h = 1 / 32
    >>> k = torch.tensor([[0., -1, 0], [-1, 4, -1], [0, -1, 0]], dtype=torch.float64) / h ** 2
    >>> apply = lambda v: F.conv2d(v, k.view(1, 1, 3, 3), padding=1)
    >>> e = F.pad(torch.rand(2, 1, 31, 31, dtype=torch.float64), [1, 1, 1, 1])
    >>> n2 = operator_norm(apply(e), Block((33, 33)), apply, spacing=(h, h))
    >>> ratio = n2 / (h * h * (e * apply(e)).flatten(1).sum(1))
    >>> bool(((ratio > 0.5) & (ratio <= 1)).all())
    True
    """
    block, spacing = block_and_spacing(where, spacing, "operator_norm")
    shape = one_field_shape(r, block, "operator_norm: r")
    if not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1
               for k in (smoothing, cycles)):
        raise ValueError(f"smoothing and cycles must be integers >= 1, got smoothing="
                         f"{smoothing!r}, cycles={cycles!r}")
    x = r.reshape(shape)
    mask = interior_mask(block, interior, x)
    masked = lambda v: mask * apply(mask * v)       # noqa: E731 (A restricted to the unknowns)
    with torch.no_grad():
        stencil = whole_stencil(masked, x.detach(), block)
        if check:
            check_stencil(stencil, masked, block)
        hierarchy = build_hierarchy(stencil, levels)
        z = vcycles(hierarchy, block.gather_whole((x * mask).detach().contiguous()), smoothing,
                    cycles)
    rz = (x * mask * block.local(z)).flatten(1).sum(1)
    return math.prod(spacing) * (2 * rz - rz.detach())


def whole_stencil(apply, like: torch.Tensor, block) -> torch.Tensor:
    """(B, 3^d, *grid) the radius-1 stencil of the linear ``apply``, probed on ``block``'s
    nodes (``like``: (B, 1, *shape) there) and gathered whole on every block."""
    return block.gather_whole(probe(apply, like, block.start, block.grid).contiguous())


def check_stencil(s: torch.Tensor, apply, block, who: str = "operator_norm") -> None:
    """ValueError, its message naming ``who``, unless the whole grid's stencil ``s`` (B, 3^d,
    *grid) reproduces ``apply`` (on ``block``'s nodes) on a random field and is symmetric
    (A[i, i + o] = A[i + o, i])."""
    tol = 1e-9 if s.dtype == torch.float64 else 1e-4
    g = torch.Generator(device="cpu").manual_seed(0)
    v = torch.rand((s.shape[0], 1, *s.shape[2:]), generator=g, dtype=s.dtype).to(s.device)
    want = block.gather_whole(apply(block.local(v).contiguous()).contiguous())
    scale = want.abs().amax().clamp_min(torch.finfo(s.dtype).tiny)
    if float((stencil_apply(s, v) - want).abs().amax() / scale) > tol:
        raise ValueError(f"{who}: apply is not a linear operator of stencil radius 1 "
                         "(each node coupled to its 3^d neighbours): its 3^d probes do not "
                         "reproduce it on a random field. Pass the residual's linear part "
                         "(lambda v: residual(v) - residual(0)) of a compact stencil, or use "
                         "residual_norm")
    offs = offsets(s.dim() - 2)
    sym = max(float((s[:, c:c + 1] - shifted(s[:, offs.index(tuple(-k for k in o))]
                                              .unsqueeze(1), o)).abs().amax())
              for c, o in enumerate(offs))
    if sym > tol * float(s.abs().amax()):
        raise ValueError(f"{who} needs a symmetric operator (an energy's gradient, "
                         "-div(a grad u) + c u): apply's stencil is not symmetric. For a "
                         "non-symmetric one use residual_norm(..., advection=...)")
