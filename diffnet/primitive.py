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


def _hermite_cell(F: torch.Tensor, f: torch.Tensor, h: float, y: torch.Tensor):
    """y flattened per sample, its position t in [0, 1] inside cell k, and the cell's end values
    (F_k, F_k+1, f_k, f_k+1). A point before x_0 lands at t = 0 of the first cell, a point after
    the last node at t = 1 of the last, so the cell's piece gives the end values there and the
    straight continuations are added without masks (a masked ``torch.where`` costs 7-20
    multiplications on CPU, and the Lax-Oleinik loss evaluates this up to 17 times a step)."""
    b, w = F.shape
    flat = y.reshape(b, -1)
    s = flat / h
    # a non-finite point (a diverged network's answer) takes cell 0 and stays non-finite in t:
    # the loss is then NaN for the engine to handle, instead of a NaN index crashing the gather
    k = s.detach().floor().nan_to_num_(nan=0.0).clamp_(0, w - 2)   # in place: a hot path
    t = (s - k).clamp(0.0, 1.0)                 # position inside interval k, in [0, 1]
    k = k.long()
    cell = (F.gather(1, k), F.gather(1, k + 1), f.gather(1, k), f.gather(1, k + 1))
    return flat, t, cell


def primitive_at(F: torch.Tensor, f: torch.Tensor, h: float, y: torch.Tensor,
                 left: float = 0.0) -> torch.Tensor:
    """Evaluate the primitive at points y (positions from x_0), C1 in y.

    F, f: (B, W) node values of the primitive and of its derivative (from ``node_primitive``);
    y: (B, ...) points, any shape after the batch dimension. Inside [x_0, x_{W-1}] this is the
    cubic Hermite interpolant of (F, f) (error O(h^4 max|f'''|)); outside it continues with the
    constant slope ``left`` before x_0 (the value f takes there, e.g. an inflow state) and with
    slope f[W-1] after the last node. dF/dy is the interpolated f, so gradients are smooth.
    """
    flat, t, cell = _hermite_cell(F, f, h, y)
    return _value(F, f, h, flat, t, cell, left).reshape(y.shape)


def _value(F, f, h, flat, t, cell, left):
    """The primitive at the flattened points: the cell's cubic Hermite piece inside (F(x_0) at
    points before x_0, F at the last node after it), plus the straight continuations."""
    F0, F1, f0, f1 = cell
    # the Hermite basis (2t^3 - 3t^2 + 1) F0 + (3t^2 - 2t^3) F1 + h (t^3 - 2t^2 + t) f0
    # + h (t^3 - t^2) f1, factored: about half the elementwise passes (each is a trip through
    # memory)
    s = t - 1
    inside = F0 + t * (t * (3 - 2 * t) * (F1 - F0) + h * s * (s * f0 + t * f1))
    past = (flat - h * (F.shape[1] - 1)).clamp(min=0.0)     # how far beyond the last node
    value = inside + f[:, -1:] * past
    return value + left * flat.clamp(max=0.0) if left != 0.0 else value        # F(x_0) = 0


def primitive_with_slope(F: torch.Tensor, f: torch.Tensor, h: float, y: torch.Tensor,
                         left: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``primitive_at`` and its y-derivative in closed form (autograd's, to rounding), no graph.

    Inside cell k, at position t, the derivative of the cubic Hermite piece:
    (6t^2 - 6t)(F_k - F_k+1)/h + (3t^2 - 4t + 1) f_k + (3t^2 - 2t) f_k+1; ``left`` before x_0
    and f[W-1] after the last node. For a loss whose gradient is known without a graph.
    """
    with torch.no_grad():
        flat, t, cell = _hermite_cell(F, f, h, y)
        F0, F1, f0, f1 = cell
        s = t - 1                  # the derivative above, factored as in _value
        slope = s * (6 * t * (F0 - F1) / h + (3 * t - 1) * f0) + t * (3 * t - 2) * f1
        # after the last node t = 1 gives f[W-1] already; before x_0, t = 0 gives f[0]
        before = flat.neg().clamp(min=0.0).sign()               # 1 before x_0, else 0
        slope = slope + (left - f[:, :1]) * before
        value = _value(F, f, h, flat, t, cell, left)
    return value.reshape(y.shape), slope.reshape(y.shape)
