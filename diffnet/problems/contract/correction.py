"""The coarse correction of an answer: the minimiser of the problem's own training loss over
the answer's local rescalings on a coarse partition, for any linear PDE with a quadratic loss
(``coarse_correction``; the engine's ``problem.correction``).

For an answer u with boundary lift g (``impose`` of the zero output) and v = u - g on the
nodes ``impose`` leaves free, the corrected answer is

    u + sum_a d_a phi_a v,     d = argmin L(u + sum_a d_a phi_a v),

phi_a the (m + 1)^d tensor-product hats of an m^d coarse partition (bilinear / trilinear in the
node index, a partition of unity). The span holds v itself, so the loss can only fall, and
the correction is the partition-of-unity Galerkin method (Melenk and Babuska, 1996) with the
network's answer as the local shape: the network has to get the solution's shape right, the
amplitudes region by region come from the equation. For an energy (or ``residual_energy``)
that is the best answer in the energy norm over the span; for a residual norm the best in
that norm. It is the Ritz head's partition (:mod:`.ritz`) for any problem, from its loss alone.

Why the loss, not the PDE: every problem has one and nothing else is needed of it. With L
quadratic in u its gradient is affine, g(u + w) = g(u) + H w, so the system G d = -b is
assembled from gradients alone (autograd through the loss, float64, the whole grid):
G_ab = (phi_a v) . H (phi_b v) and b_a = (phi_a v) . g(u), J + 1 gradients of J = (m + 1)^d
fields per answer. A non-linear PDE or loss (Burgers' Lax-Oleinik functional) has no such G:
a probe (g(u + 2v) - g(u) against twice g(u + v) - g(u)) refuses it, naming the problem.

Cost: the J gradients are one batched pass of the loss over J fields per answer; at 64 x 64
with m = 8 (J = 81) a few times a direct sparse solve of the same grid, at 32^3 with m = 4
(J = 125) about the network's own forward pass. It runs on the whole grid of one process (a
domain split gathers the answer first).

>>> import torch
>>> from diffnet.problems import get_problem, coarse_correction
>>> p = get_problem("poisson", grid=(17, 17))
>>> x = p.build_input(p.sample_params(0, range(2)), torch.float64)
>>> u = p.answer(0.1 * torch.randn(2, 1, 17, 17, dtype=torch.float64), x)
>>> fixed = coarse_correction(p, u, x, cells=4)
>>> loss = lambda w: sum(p.loss_terms(w, x).values())
>>> bool((loss(fixed) <= loss(u)).all())
True
"""
from __future__ import annotations

import math

import numpy as np
import torch

from diffnet.problems.contract.loss_residual import free_nodes, loss_gradient, whole_copy
from diffnet.problems.contract.ritz import coarse_lines, line_hats, solve_gram
from diffnet.validation import check_int

# relative departure from an affine gradient above which the loss is taken as non-quadratic:
# float64 rounding of a gradient sums ~1e-13; a non-linear loss departs at order one
AFFINE_RTOL = 1e-6


def partition_hats(grid, cells: int) -> torch.Tensor:
    """(J, *grid) float64 tensor-product hats of a ``cells``^d coarse partition of ``grid``
    (J = (cells + 1)^d), summing to one at every node; ``cells`` 0: the one constant field."""
    if cells == 0:
        return torch.ones(1, *grid, dtype=torch.float64)
    out = None
    for n in grid:
        h = line_hats(n, coarse_lines(n, cells))                    # (cells + 1, n)
        out = h if out is None else (out[:, None, ..., None] * h.view(
            1, h.shape[0], *([1] * (out.dim() - 1)), n)).reshape(-1, *out.shape[1:], n)
    return out


def check_cells(cells, grid) -> int:
    """``cells`` as an int in 0 .. min(grid) - 1; ValueError naming the fix otherwise."""
    cells = check_int("the coarse correction's cells", cells, 0)
    if cells > min(grid) - 1:
        raise ValueError(f"the coarse correction's cells = {cells} needs at least {cells + 1} "
                         f"nodes per axis, the grid is {list(grid)}: use at most "
                         f"{min(grid) - 1}")
    return cells


def coarse_correction(problem, u, inputs, cells: int, *, fields_per_pass: int = 512):
    """(B, 1, *grid) the answers ``u`` (B, 1, *grid) to ``inputs`` (B, C, *grid) corrected by
    the minimiser of ``problem``'s loss over their rescalings by the hats of a ``cells``^d
    coarse partition (module docstring), in u's dtype; torch tensors on the problem's whole
    grid. A non-finite answer is returned as it is. ValueError where the loss is not quadratic
    in the answer. ``fields_per_pass`` bounds the fields one gradient pass takes (memory)."""
    cells = check_cells(cells, problem.grid)
    with torch.inference_mode(False), torch.enable_grad():
        p = whole_copy(problem)
        # ordinary float64 tensors, whatever mode or dtype the caller's are in
        x = torch.from_numpy(np.array(inputs.detach().cpu().double().numpy()))
        w = torch.from_numpy(np.array(u.detach().cpu().double().numpy()))
        phi = partition_hats(p.grid, cells)
        out = [correct_one(p, w[i:i + 1], x[i:i + 1], phi, fields_per_pass)
               for i in range(len(w))]
    return torch.cat(out).to(u.dtype) if out else u


def correct_one(p, u, x, phi, fields_per_pass: int) -> torch.Tensor:
    """(1, 1, *grid) one answer corrected (float64): the Galerkin system from J + 1 gradients."""
    if not bool(torch.isfinite(u).all()):
        return u
    free, lift = free_nodes(p, x)
    v = (u - lift) * free
    g = loss_gradient(p, u, x).detach() * free
    f = v * phi[:, None]                                              # (J, 1, *grid)
    hf = torch.cat([gradient_steps(p, u, x, free, g, f[s:s + fields_per_pass])
                    for s in range(0, len(f), fields_per_pass)])
    check_affine(p, u, x, free, g, v, hf, f)
    j = len(f)
    fv, hv = f.reshape(j, -1), hf.reshape(j, -1)
    gram = (fv @ hv.T)[None]
    rhs = -(fv @ g.reshape(-1))[None]
    scale = math.sqrt(float(gram.diagonal(dim1=1, dim2=2).abs().mean()) or 1.0)
    d = solve_gram(gram / scale ** 2, rhs / scale ** 2)[0]            # scaled: a loss's units
    return u + (d.view(j, *([1] * (f.dim() - 1))) * f).sum(0, keepdim=True)


def gradient_steps(p, u, x, free, g, f) -> torch.Tensor:
    """H f = g(u + f) - g(u) at the free nodes for the fields f (k, 1, *grid)."""
    k = len(f)
    return (loss_gradient(p, u.expand(k, *u.shape[1:]) + f,
                          x.expand(k, *x.shape[1:])).detach() * free) - g


def check_affine(p, u, x, free, g, v, hf, f) -> None:
    """ValueError unless the loss's gradient is affine in the answer along v: H (2 v) from a
    gradient at u + 2 v against twice H v from the hats' (the hats sum to one)."""
    twice = (loss_gradient(p, u + 2 * v, x).detach() * free) - g
    once = hf.sum(0, keepdim=True)
    size = float(twice.norm())
    if size == 0.0:
        return
    departure = float((twice - 2 * once).norm()) / size
    if not departure <= AFFINE_RTOL:
        raise ValueError(
            f"problem {p.name!r}: its loss is not quadratic in the answer (its gradient departs "
            f"from an affine one by {departure:.1e} relative), so the coarse correction, the "
            f"loss's minimiser over the answer's coarse rescalings, is not a linear solve: it "
            f"needs a linear PDE and an energy or residual-norm loss; set problem.correction "
            f"= 0")
