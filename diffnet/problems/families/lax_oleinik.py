"""The per-node Lax-Oleinik functional of Burgers' equation with its gradient in closed form.

    g(u; x, t) = (U0(x - u t) - U0(x)) / t + u^2 / 2,      dg/du = u - u0(x - u t)

(U0 the primitive of the initial condition, ``diffnet.primitive``). Its Gaussian average
E[g(u + s Z)] (the smoothing homotopy) is a sum over quadrature points. Autograd through the
cubic Hermite evaluation records ~40 elementwise operations per point and node; the derivative
above is the characteristic equation, so the forward pass computes it beside the value and the
backward pass is one multiplication. Same value and gradient (to rounding; float64 test against
autograd). The gain is memory: only the slope is kept for backward, not the quadrature's
intermediates (about 100x less with the smoothing on); the time is about the same.
"""
from __future__ import annotations

import numpy as np
import torch

from diffnet.primitive import primitive_at, primitive_with_slope

# probabilists' Gauss-Hermite rule: E[f(u + s Z)], Z ~ N(0, 1), exact for polynomials of degree 15
_GH_Z, _GH_W = np.polynomial.hermite_e.hermegauss(8)
_GH_W = _GH_W / _GH_W.sum()


def smoothing_points(sigma: float) -> list[tuple[float, float]]:
    """(shift, weight) pairs of the Gaussian average E[g(u + sigma Z)] (8-point Gauss-Hermite),
    or [(0, 1)] (g itself) when sigma <= 0."""
    if sigma <= 0:
        return [(0.0, 1.0)]
    return [(sigma * float(z), float(w)) for z, w in zip(_GH_Z, _GH_W)]


class _Functional(torch.autograd.Function):
    """sum_q w_q g(v + s_q): forward computes the slope beside the value, backward scales it."""

    @staticmethod
    def forward(ctx, v, big_u0, u0, x, t, here, dx, points):
        if any(ctx.needs_input_grad[1:]):
            raise RuntimeError("lax_oleinik_nodes: the gradient with respect to the initial "
                               "condition or the coordinates is not implemented (only u is "
                               "trained)")
        value, slope = torch.zeros_like(v), torch.zeros_like(v)
        for shift, weight in points:
            val = v + shift
            big, small = primitive_with_slope(big_u0, u0, dx, x - val * t)
            value += weight * ((big - here) / t + 0.5 * val * val)
            slope += weight * (val - small)          # d/dval of U0(x - val t) is -t u0(...)
        ctx.save_for_backward(slope)
        return value

    @staticmethod
    def backward(ctx, grad):
        (slope,) = ctx.saved_tensors
        return (grad * slope,) + (None,) * 7


def lax_oleinik_nodes(v: torch.Tensor, big_u0: torch.Tensor, u0: torch.Tensor, x: torch.Tensor,
                      t: torch.Tensor, here: torch.Tensor, dx: float,
                      points: list[tuple[float, float]]) -> torch.Tensor:
    """sum over (shift s, weight w) in ``points`` of w g(v + s) at every node.

    v: (B, H', W) node values; big_u0, u0: (B, W) the primitive and the initial condition on the
    whole x row (``node_primitive``); x: (W,) and t: (H', 1) node positions (t > 0); here: U0(x),
    broadcastable to v. ``points = [(0.0, 1.0)]`` is g itself."""
    return _Functional.apply(v, big_u0, u0, x, t, here, dx, points)


def lax_oleinik_value(v: torch.Tensor, big_u0: torch.Tensor, u0: torch.Tensor, x: torch.Tensor,
                      t: torch.Tensor, here: torch.Tensor, dx: float) -> torch.Tensor:
    """g(v) itself at every node, without the slope: what the basin search compares (nine
    evaluations per step at reach 4, under no_grad, so the slope ``lax_oleinik_nodes`` computes
    for backward would be wasted work). Differentiable by autograd through the primitive.
    Arguments as
    ``lax_oleinik_nodes``."""
    return (primitive_at(big_u0, u0, dx, x - v * t) - here) / t + 0.5 * v * v


def _shift_x(v: torch.Tensor, k: int) -> torch.Tensor:
    """v moved k nodes along x (the last axis), the edge node repeated: node j holds v[j - k]."""
    if k > 0:
        return torch.cat([v[..., :1].expand(*v.shape[:-1], k), v[..., :-k]], dim=-1)
    return torch.cat([v[..., -k:], v[..., -1:].expand(*v.shape[:-1], -k)], dim=-1)


def basin_targets(v: torch.Tensor, value_at, reach: int) -> torch.Tensor:
    """For every node, the value among its own and its x-neighbours' (up to ``reach`` nodes on
    either side) at which THIS node's functional is lowest; no gradient.

    ``value_at(c)`` evaluates g at every node for the candidate values c (same shape as v). A
    node left in the wrong basin behind a shock is a local minimum of g, so the functional's
    gradient cannot move it; its neighbour across the shock holds a value of the other basin,
    and if that value gives this node a lower g it becomes the node's target (the global
    minimiser over u is the entropy solution, Lax-Oleinik)."""
    with torch.no_grad():
        best, best_g = v, value_at(v)
        for k in range(1, reach + 1):
            for cand in (_shift_x(v, k), _shift_x(v, -k)):
                g = value_at(cand)
                # 1 where strictly lower (ties keep the earlier, nearer candidate), else 0;
                # lerp with weight 0 or 1 returns an end exactly, and is much cheaper than
                # a masked torch.where on CPU (lab/notes/performance.md)
                better = (best_g - g).clamp(min=0.0).sign()
                best, best_g = torch.lerp(best, cand, better), torch.minimum(best_g, g)
    return best
