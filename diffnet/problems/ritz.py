"""The Ritz-Galerkin answer of a linear problem with an energy, from the network's fields.

For a problem whose solution minimises E(u) = a(u, u) / 2 - l(u) over a linear space (zero
boundary data: every combination of admissible fields is admissible), the best answer in the
span of K fields u_1..u_K is exact and cheap: sum_i c_i u_i with G c = b, G_ij = a(u_i, u_j),
b_i = l(u_i), per sample (a K x K solve), and its energy is -b.G^-1.b / 2. K = 1 is the
scaling c = l(u) / a(u, u). The problem gives its quadratic energy as weighted squares,
a(u, u) / 2 = sum over pairs (F, w) of sum(w F(u)^2) with F linear, so G is sums of
w F(u_i) F(u_j): one batched product, K evaluations of F rather than the K (K + 1) / 2 energies
that polarisation (a(u + v, u + v) - a(u, u) - a(v, v)) would take (``python -m
bench.ritz_bench``: 0.44 s against 5.9 s for impose + energy + backward at 512x512, K = 16,
two samples, one thread). The network then only has to span the solution, not to get its
amplitudes right: the amplitudes are global (for Darcy the effective conductivity of the whole
medium) and the energy's flattest directions, where gradient training converges slowest.
"""
from __future__ import annotations

from typing import Callable

import torch

# G + REG * mean(diag G) * I: fields a network makes nearly dependent (at initialisation, say)
# give a near-singular G; the shift bounds c at a relative energy cost of ~REG.
REG = 1e-7


def gram(features: list, b: int, k: int) -> torch.Tensor:
    """(b, k, k) float64 a(u_i, u_j) from the pairs (F, w) of b samples' k fields (F's first
    dims (b, k) or (b * k,)): a(u, v) = 2 sum over the pairs of sum(w F(u) F(v)). The products
    run in the fields' dtype (float32 in training): they subtract nothing, so they are no less
    exact than the energies themselves."""
    g = 0
    for f, w in features:
        fw = (f * w).reshape(b, k, -1)
        g = g + 2 * torch.bmm(fw, f.reshape(b, k, -1).transpose(1, 2)).double()
    return g


def ritz_combination(u: torch.Tensor, features: Callable, ell: Callable,
                     total: Callable) -> torch.Tensor:
    """(B, 1, *grid) the energy's minimiser in the span of the K fields of u (B, K, *grid).

    ``features(u)``: the pairs (F, w) of the fields u (B, K, *grid), F (B, K, ...), with
    a(u_i, u_i) / 2 = sum over the pairs of sum(w F^2) over field i's entries (see
    ``diffusion_features``); ``ell(v)``: (N,) l(v) of v (N, 1, *grid), N = B * K
    (sample-major: the fields of sample 0 first). On a split grid both give this
    block's parts, and ``total`` sums a tensor over the blocks (identity when undivided). G and
    b are assembled and G c = b is solved in float64."""
    b, k = u.shape[:2]
    v = u.float() if u.dtype in (torch.float16, torch.bfloat16) else u
    flat = v.reshape(b * k, 1, *v.shape[2:])
    g = total(gram(features(v), b, k))
    rhs = total(ell(flat).view(b, k)).double()
    if k == 1:
        c = rhs / g[:, :, 0].clamp_min(torch.finfo(g.dtype).tiny)
    else:
        g = 0.5 * (g + g.transpose(1, 2))                         # symmetric to rounding
        shift = REG * g.diagonal(dim1=1, dim2=2).mean(dim=1).clamp_min(torch.finfo(g.dtype).tiny)
        g = g + shift.view(b, 1, 1) * torch.eye(k, dtype=g.dtype)
        c = torch.linalg.solve(g, rhs.unsqueeze(-1)).squeeze(-1)
    return (u * c.to(u.dtype).view((b, k) + (1,) * (u.dim() - 2))).sum(dim=1, keepdim=True)
