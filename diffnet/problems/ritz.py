"""The Ritz-Galerkin answer of a linear problem with an energy, from the network's fields.

For a problem whose solution minimises E(u) = a(u, u) / 2 - l(u) over a linear space (zero
boundary data: every combination of admissible fields is admissible), the best answer in the
span of K fields u_1..u_K is exact and cheap: sum_i c_i u_i with G c = b, G_ij = a(u_i, u_j),
b_i = l(u_i), per sample (a K x K solve), and its energy is -b.G^-1.b / 2. K = 1 is the
scaling c = l(u) / a(u, u). The network then only has to span the solution, not to get its
amplitudes right: the amplitudes are global (for Darcy the effective conductivity of the whole
medium) and the energy's flattest directions, where gradient training converges slowest.
"""
from __future__ import annotations

from typing import Callable

import torch

# G + REG * mean(diag G) * I: fields a network makes nearly dependent (at initialisation, say)
# give a near-singular G; the shift bounds c at a relative energy cost of ~REG.
REG = 1e-7


def ritz_combination(u: torch.Tensor, half_a: Callable, ell: Callable,
                     total: Callable) -> torch.Tensor:
    """(B, 1, *grid) the energy's minimiser in the span of the K fields of u (B, K, *grid).

    ``half_a(v)`` and ``ell(v)``: (N,) a(v, v) / 2 and l(v) of fields v (N, 1, *grid), N a
    multiple of B (sample-major: the fields of sample 0 first); on a split grid, this block's
    parts, and ``total`` sums a tensor over the blocks (identity when undivided). The energies
    are in float32 at least; for K > 1 the K x K system is assembled and solved in float64 (its
    off-diagonal entries are differences of energies)."""
    b, k = u.shape[:2]
    v = u.float() if u.dtype in (torch.float16, torch.bfloat16) else u
    if k == 1:
        c = total(ell(v)) / (2 * total(half_a(v))).clamp_min(torch.finfo(v.dtype).tiny)
        return u * c.to(u.dtype).view((b,) + (1,) * (u.dim() - 1))  # u = 0 gives c = 0
    pairs = [(i, j) for i in range(k) for j in range(i + 1, k)]
    sums = torch.stack([v[:, i] + v[:, j] for i, j in pairs], dim=1)
    fields = torch.cat([v, sums], dim=1)                           # (B, K + K(K-1)/2, *grid)
    m = fields.shape[1]
    flat = fields.reshape(b * m, 1, *fields.shape[2:])
    q = total(half_a(flat).view(b, m)).double()                    # a(w, w) / 2 of each field
    rhs = total(ell(v.reshape(b * k, 1, *v.shape[2:])).view(b, k)).double()
    g = torch.diag_embed(2 * q[:, :k])
    for n, (i, j) in enumerate(pairs):                             # polarisation
        g[:, i, j] = g[:, j, i] = q[:, k + n] - q[:, i] - q[:, j]
    shift = REG * g.diagonal(dim1=1, dim2=2).mean(dim=1).clamp_min(torch.finfo(g.dtype).tiny)
    g = g + shift.view(b, 1, 1) * torch.eye(k, dtype=g.dtype)
    c = torch.linalg.solve(g, rhs.unsqueeze(-1)).squeeze(-1)
    return (u * c.to(u.dtype).view((b, k) + (1,) * (u.dim() - 2))).sum(dim=1, keepdim=True)
