"""The primitive F(y) = int_0^y f of a function sampled on uniform nodes, evaluable anywhere.

Used by the variational (Lax-Oleinik) Burgers loss, which needs U0(y) = int_0^y u0 at the feet
y = x - u t of characteristics: points between nodes, differentiable in y. Everything works on
torch tensors along the last dimension, so a batch of initial conditions is one call.
"""
from __future__ import annotations

import torch


def node_primitive(f: torch.Tensor, h: float) -> torch.Tensor:
    """F[..., j] = int_{x_0}^{x_j} f for samples f[..., j] = f(x_0 + j h) (W >= 4 nodes).

    Each interval integral is that of the cubic through the 4 nearest nodes (fourth order):
    interior intervals  int_{x_j}^{x_j+1} = h/24 (-f[j-1] + 13 f[j] + 13 f[j+1] - f[j+2]);
    the first and last intervals use the one-sided cubic  h/24 (9 f0 + 19 f1 - 5 f2 + f3)
    (mirrored at the right end). F[..., 0] = 0; error O(h^4 max|f''''|) per unit length.
    """
    if f.shape[-1] < 4:
        raise ValueError(f"node_primitive needs at least 4 nodes, got {f.shape[-1]}")
    first = 9 * f[..., 0] + 19 * f[..., 1] - 5 * f[..., 2] + f[..., 3]
    inner = -f[..., :-3] + 13 * f[..., 1:-2] + 13 * f[..., 2:-1] - f[..., 3:]
    last = 9 * f[..., -1] + 19 * f[..., -2] - 5 * f[..., -3] + f[..., -4]
    pieces = torch.cat([first[..., None], inner, last[..., None]], dim=-1) * (h / 24)
    return torch.cat([torch.zeros_like(f[..., :1]), pieces.cumsum(dim=-1)], dim=-1)


def primitive_at(F: torch.Tensor, f: torch.Tensor, h: float, y: torch.Tensor,
                 left: float = 0.0, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Evaluate the primitive at points y (positions from x_0), C1 in y.

    F, f: (B, W) node values of the primitive and of its derivative (from ``node_primitive``);
    y: (B, ...) points, any shape after the batch dimension. Inside [x_0, x_{W-1}] this is the
    cubic Hermite interpolant of (F, f) (error O(h^4 max|f'''|)); outside it continues with the
    constant slope ``left`` before x_0 (the value f takes there, e.g. an inflow state) and with
    slope f[W-1] after the last node. dF/dy is the interpolated f, so gradients are smooth.
    With ``rows`` (P,) (long), y is (P,): point p is evaluated on row rows[p] of F and f (a
    scattered subset of several rows' points, without copying the rows).
    """
    w = F.shape[1]
    flat = y.reshape(F.shape[0], -1) if rows is None else y.reshape(-1, 1)
    s = flat / h
    k = s.detach().floor().clamp(0, w - 2)
    t = (s - k).clamp(0.0, 1.0)                 # position inside interval k, in [0, 1]
    k = k.long()
    F0, F1, f0, f1 = _gather_pairs(F, f, k, rows)
    t2, t3 = t * t, t * t * t
    inside = ((2 * t3 - 3 * t2 + 1) * F0 + (-2 * t3 + 3 * t2) * F1
              + h * ((t3 - 2 * t2 + t) * f0 + (t3 - t2) * f1))
    span = h * (w - 1)
    below = left * flat                          # F(x_0) = 0
    last = slice(None) if rows is None else rows
    above = F[last, -1:] + f[last, -1:] * (flat - span)
    out = torch.where(flat < 0, below, torch.where(flat > span, above, inside))
    return out.reshape(y.shape)


def _gather_pairs(F, f, k, rows):
    """F[k], F[k + 1], f[k], f[k + 1]: per row of k (rows None), or on the given rows of F and
    f (k (P, 1))."""
    if rows is None:
        return F.gather(1, k), F.gather(1, k + 1), f.gather(1, k), f.gather(1, k + 1)
    at = rows[:, None] * F.shape[1] + k
    flat_F, flat_f = F.reshape(-1), f.reshape(-1)
    return flat_F[at], flat_F[at + 1], flat_f[at], flat_f[at + 1]


def primitive_derivatives_at(F: torch.Tensor, f: torch.Tensor, h: float, y: torch.Tensor,
                             left: float = 0.0):
    """(F(y), F'(y), F''(y)) of the interpolant of ``primitive_at`` (same arguments), in closed
    form: F' is the interpolated f (continuous, quadratic between nodes), F'' its slope (linear
    between nodes, jumping at them); outside the nodes F' is the constant slope and F'' = 0.
    For Newton steps on functionals of F, where autograd would cost a backward pass per
    derivative."""
    b, w = F.shape
    flat = y.reshape(b, -1)
    s = flat / h
    k = s.floor().clamp(0, w - 2)
    t = (s - k).clamp(0.0, 1.0)
    k = k.long()
    F0, F1, f0, f1 = _gather_pairs(F, f, k, None)
    t2, t3 = t * t, t * t * t
    val = ((2 * t3 - 3 * t2 + 1) * F0 + (-2 * t3 + 3 * t2) * F1
           + h * ((t3 - 2 * t2 + t) * f0 + (t3 - t2) * f1))
    d1 = (6 * t2 - 6 * t) * (F0 - F1) / h + (3 * t2 - 4 * t + 1) * f0 + (3 * t2 - 2 * t) * f1
    d2 = ((12 * t - 6) * (F0 - F1) / h + (6 * t - 4) * f0 + (6 * t - 2) * f1) / h
    span = h * (w - 1)
    below, above = flat < 0, flat > span
    val = torch.where(below, left * flat,
                      torch.where(above, F[:, -1:] + f[:, -1:] * (flat - span), val))
    d1 = torch.where(below, torch.full_like(d1, left), torch.where(above, f[:, -1:].expand_as(d1), d1))
    d2 = torch.where(below | above, torch.zeros_like(d2), d2)
    return tuple(v.reshape(y.shape) for v in (val, d1, d2))
