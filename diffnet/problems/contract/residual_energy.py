"""The energy whose gradient is a residual: the Ritz loss of any linear PDE with a symmetric
positive operator, from its residual alone, without writing the energy down.

For a residual r(u) = A u - f on the unknown nodes (those ``interior`` or more from the
boundary; the others hold Dirichlet data, fixed by the problem's imposition) with A
symmetric positive definite, the discrete energy with the boundary values fixed is::

    J(u) = vol * ( u_I . r(u) - u_I . A (M u) / 2 ),      M the mask of the unknown nodes

(= vol (u_I . A_II u_I / 2 + u_I . (A_IB u_B - f)); its gradient with respect to u_I is
vol * r(u), its minimiser the discrete solution, and J(u) - J(u*) = vol e^T A e / 2: the
energy norm of the error, the exact form of what :func:`~diffnet.problems.operator_norm`
approximates with a V-cycle. Its Hessian is the operator itself, conditioned like h^-2 where the
squared residual's is h^-4, and it needs no preconditioner, so it does not depend on how well
multigrid handles the operator (strong anisotropy, where point smoothers fail).

Why not always: the energy exists only for a symmetric A; a non-symmetric residual (advection)
is not the gradient of anything, so the helper probes ``apply`` (3^d calls on colour fields,
as operator_norm does) and refuses it, naming residual_norm. A indefinite (a Helmholtz equation
with the wrong sign) makes J unbounded below: training diverges, so the loss is for positive
operators only (-div(a grad u) + c u, c >= 0, any a). The Dirichlet nodes must be fixed by the
problem's imposition (a lift plus a factor vanishing there): a soft penalty on them would add
a gradient J does not have.

Gradient without an autograd graph through the residual: the value is computed with no
graph and the loss written J + vol M (u - u.detach()) . r.detach(), value J, gradient vol M r,
which is J's gradient for a symmetric A (exactly the residual: the answer check's dL/du is the
residual itself).

Split grid: every term is a sum over nodes, so each block returns its nodes' part and the parts
sum to the undivided value (the engine sums the blocks' losses); ``apply`` does its own halo
exchange as the residual does. The symmetry probe gathers the stencil whole, so call it with
``check=False`` after the first step where the grid is too big to gather (the operator's form
does not change with the draw).
"""
from __future__ import annotations

import math

import torch

from diffnet.problems.contract.blocks import block_and_spacing, interior_mask, one_field_shape
from diffnet.problems.contract.operator_norm import check_stencil, whole_stencil


def residual_energy(r: torch.Tensor, u: torch.Tensor, where, apply, *, spacing=None,
                    interior=1, check: bool = True) -> torch.Tensor:
    """(B,) the energy J(u) whose gradient is the residual ``r`` (module docstring: the
    formula, when it applies), differentiable in u; on a split block, this block's part.

    Args:
        r: the residual r(u) = A u - f at the nodes, (B, *shape) or (B, 1, *shape), on the
            block of ``where``; computed from ``u``.
        u: the answer it is the residual of, the same shape; its nodes closer than
            ``interior`` to the boundary hold the Dirichlet data.
        where: a problem (its ``block`` and ``spacing`` are used), or a ``Block``.
        apply: v -> A v, the residual's linear part (``lambda v: residual(v) - residual(0)``),
            symmetric positive definite on the unknown nodes, radius 1 when ``check``.
        spacing: the node spacing per axis; needed with a Block, default the problem's.
        interior: nodes closer than this to the boundary (an int, or one per axis) are
            Dirichlet nodes, not unknowns.
        check: probe ``apply``'s stencil and refuse it unless it reproduces ``apply`` and is
            symmetric (3^d + 1 more calls; ValueError naming the alternative).

    Example, the five-point -Laplacian with f = 1 on a 33 x 33 grid, u = 0 on the walls: J is
    the quadratic whose gradient is the residual, J(w + e) = J(w) + vol e.r(w) + vol e.Ae / 2:

    >>> import torch, torch.nn.functional as F
    >>> from diffnet.domain import Block
    >>> from diffnet.problems import residual_energy
    >>> h = 1 / 32
    >>> k = torch.tensor([[0., -1, 0], [-1, 4, -1], [0, -1, 0]], dtype=torch.float64) / h ** 2
    >>> apply = lambda v: F.conv2d(v, k.view(1, 1, 3, 3), padding=1)
    >>> field = lambda: F.pad(torch.rand(1, 1, 31, 31, dtype=torch.float64), [1, 1, 1, 1])
    >>> energy = lambda v: residual_energy(apply(v) - 1, v, Block((33, 33)), apply,
    ...                                    spacing=(h, h))
    >>> w, e = field(), field()
    >>> step = h * h * ((e * (apply(w) - 1))[..., 1:-1, 1:-1].sum() + (e * apply(e)).sum() / 2)
    >>> bool(torch.allclose(energy(w + e) - energy(w), step))
    True
    """
    block, spacing = block_and_spacing(where, spacing, "residual_energy")
    shape = one_field_shape(r, block, "residual_energy: r")
    if one_field_shape(u, block, "residual_energy: u") != shape:
        raise ValueError(f"residual_energy: r and u must have the same shape, got "
                         f"{tuple(r.shape)} and {tuple(u.shape)}")
    x, v = r.reshape(shape), u.reshape(shape)
    mask = interior_mask(block, interior, x)
    with torch.no_grad():
        if check:
            masked = lambda w: mask * apply(mask * w)       # noqa: E731 (A on the unknowns)
            check_stencil(whole_stencil(masked, x.detach(), block), masked, block,
                          who="residual_energy")
        vd, rd = v.detach(), x.detach() * mask
        value = (vd * rd).flatten(1).sum(1) - (vd * mask * apply(mask * vd)).flatten(1).sum(1) / 2
    slope = ((v - vd) * rd).flatten(1).sum(1)
    return math.prod(spacing) * (value + slope)
