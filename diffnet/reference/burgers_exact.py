"""Exact entropy solution of inviscid Burgers by the Lax-Oleinik formula (numpy only, no torch).

For u_t + (u^2/2)_x = 0 (convex flux) the entropy solution is, at every (x, t > 0) off a shock,

    u(x, t) = (x - y*) / t,    y* = argmin_y G(y),    G(y) = U0(y) + (x - y)^2 / (2 t),

with U0(y) = int_0^y u0 the primitive of the initial condition (Lax 1957, Oleinik 1957; Evans,
*Partial Differential Equations*, section 3.4.2). The minimiser is the foot of the one
characteristic that survives: where several cross (behind a shock) the smallest G wins, which
puts every shock where Rankine-Hugoniot and the entropy condition put it, with no smearing.

Domain [0, 1] with the inflow state 0 at x = 0 (the boundary condition of the DiffNet problem)
and u0 >= 0: every characteristic enters through t = 0 or x = 0 and travels right, so u0
extended by 0 for y < 0 gives the solution on [0, 1] (U0 = 0 there, and the best y < 0 is
y = 0); nothing comes from x > 1 (the feet satisfy y* = x - u t <= x), so x = 1 needs no
condition. u0 < 0 anywhere is refused (characteristics would enter through x = 1).

Evaluation: U0 by 3-point Gauss-Legendre quadrature on ``oversample`` fine cells per output
interval; the global minimum of G over that fine grid picks the branch; bisection on
G'(y) = u0(y) - (x - y) / t in the two fine cells around it refines the foot to round-off, so
u = u0(y*) holds to machine precision off shocks. At a node exactly on a shock the two minima
tie and either one-sided state may be returned.
"""
from __future__ import annotations

import numpy as np

from ..validation import check_int
from .burgers import cell_averages, check_burgers_args, eval_u0

__all__ = ["solve_burgers_exact"]

_CHUNK = 1 << 22      # candidate evaluations held at once (32 MiB of float64)


def _primitive(u0, n_cells: int) -> tuple[np.ndarray, np.ndarray]:
    """(y, U0(y)) on the fine grid y_k = k / n_cells, k = 0..n_cells."""
    cell = (1.0 / n_cells) * cell_averages(u0, n_cells)
    return np.linspace(0.0, 1.0, n_cells + 1), np.concatenate([[0.0], np.cumsum(cell)])


def _feet(u0, x: np.ndarray, t: float, y: np.ndarray, big_u0: np.ndarray) -> np.ndarray:
    """Foot y*(x) of the entropy characteristic through each (x_j, t)."""
    dy = y[1] - y[0]
    best = np.empty(x.size, dtype=np.int64)
    step = max(1, _CHUNK // y.size)
    for lo in range(0, x.size, step):
        xs = x[lo:lo + step, None]
        g = big_u0[None, :] + (xs - y[None, :]) ** 2 / (2.0 * t)
        g[y[None, :] > xs] = np.inf             # u >= 0: the foot lies left of x
        best[lo:lo + step] = np.argmin(g, axis=1)
    a = np.maximum(y[best] - dy, 0.0)
    b = np.minimum(y[best] + dy, x)
    da = eval_u0(u0, a) - (x - a) / t
    db = eval_u0(u0, b) - (x - b) / t
    bracket = (da < 0) & (db > 0)               # a root of G' (the minimum) inside [a, b]
    for _ in range(60):
        m = 0.5 * (a + b)
        dm = eval_u0(u0, m) - (x - m) / t
        left = dm > 0
        b = np.where(bracket & left, m, b)
        a = np.where(bracket & ~left, m, a)
    return np.where(bracket, 0.5 * (a + b), y[best])


def solve_burgers_exact(u0, *, x_nodes: int, t_nodes: int, t_end: float = 1 / 3,
                        oversample: int = 64) -> np.ndarray:
    """Entropy solution of u_t + (u^2/2)_x = 0 on [0, 1] x [0, t_end], inflow 0 at x = 0.

    Args:
        u0: vectorised callable x -> u0(x) >= 0 (float64 numpy array in, same shape out).
        x_nodes: output nodes in x (>= 2), spacing 1 / (x_nodes - 1).
        t_nodes: output times (>= 2), t_k = k * t_end / (t_nodes - 1); row 0 is u0 itself.
        t_end: final time (> 0).
        oversample: fine cells per output interval for the primitive and the branch search.

    Returns:
        (t_nodes, x_nodes) float64 array; row k is time t_k, column j is x_j.

    Raises:
        ValueError: on an invalid argument, or u0 < 0 somewhere on [0, 1].
    """
    x_nodes, t_nodes, t_end = check_burgers_args(u0, x_nodes, t_nodes, t_end)
    oversample = check_int("oversample", oversample, 1)
    y, big_u0 = _primitive(u0, oversample * (x_nodes - 1))
    if eval_u0(u0, y).min() < 0:
        raise ValueError("u0 must be >= 0 on [0, 1] for the Lax-Oleinik solution with inflow "
                         "at x = 0 (characteristics would enter through x = 1); use the "
                         "Godunov solver solve_burgers instead")
    x = np.linspace(0.0, 1.0, x_nodes)
    out = np.empty((t_nodes, x_nodes), dtype=np.float64)
    out[0] = eval_u0(u0, x)
    for k, t in enumerate(np.linspace(0.0, t_end, t_nodes)[1:], start=1):
        out[k] = (x - _feet(u0, x, t, y, big_u0)) / t
    return out
