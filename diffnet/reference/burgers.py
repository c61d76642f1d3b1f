"""Classical reference solver for the inviscid Burgers equation (numpy only, no torch).

Equation (conservation form, entropy solution)::

    u_t + (u^2 / 2)_x = 0,      x in [0, 1],  t in [0, t_end],
    u(x, 0) = u0(x),
    u(0, t) = 0                 (inflow boundary; imposed weakly through a ghost state 0),
    x = 1                       outflow / transmissive (zero-gradient ghost cell).

Discretisation: first-order conservative Godunov finite-volume scheme on a uniform fine grid of
``refine * (x_nodes - 1)`` cells. The interface flux is the exact Riemann (Godunov) flux of the
convex flux f(u) = u^2/2,

    F(uL, uR) = max( f(max(uL, 0)), f(min(uR, 0)) ),

which selects the entropy solution (transonic rarefactions included). Forward Euler in time with
CFL-limited steps dt = cfl * dx / max|u|, shortened so that steps land exactly on the output
times t_k = k * t_end / (t_nodes - 1). The scheme is monotone (hence TVD, satisfies the discrete
maximum principle and converges to the entropy solution) for cfl <= 1. Order: first order in
space and time for smooth solutions (O(dx) in the max norm before shocks form); for solutions
with shocks the L1 error is O(dx) (O(dx^{1/2}) is the worst case guaranteed by Kuznetsov theory).

Sampling onto the (t_nodes, x_nodes) node grid: node j sits exactly on fine-grid face
``j * refine``; interior node values are the linear interpolation of the two adjacent cell
averages (their mean). The boundary nodes take the exact Riemann state at the boundary face
(inflow ghost 0 at x = 0, zero-gradient ghost at x = 1, i.e. the last cell average there). Row 0
is u0 evaluated at the nodes exactly. Initial cell averages use 3-point Gauss-Legendre quadrature
of u0 on each cell (error O(dx^6)).
"""
from __future__ import annotations

import math

import numpy as np

from diffnet.validation import check_int, check_number

# The solver; check_burgers_args, eval_u0 and cell_averages are public helpers shared with the
# exact solver (burgers_exact), which validates and integrates u0 the same way.
__all__ = ["solve_burgers", "riemann_state"]

_GAUSS_X = np.array([-math.sqrt(0.6), 0.0, math.sqrt(0.6)])  # on [-1, 1]
_GAUSS_W = np.array([5.0, 8.0, 5.0]) / 18.0                  # weights summing to 1


def riemann_state(u_left, u_right):
    """State at x/t = 0 of the entropy solution of the Burgers Riemann problem (vectorised)."""
    u_left = np.asarray(u_left, dtype=np.float64)
    u_right = np.asarray(u_right, dtype=np.float64)
    shock_state = np.where(0.5 * (u_left + u_right) >= 0.0, u_left, u_right)
    fan_state = np.where(u_left >= 0.0, u_left, np.where(u_right <= 0.0, u_right, 0.0))
    return np.where(u_left > u_right, shock_state, fan_state)


def check_burgers_args(u0, x_nodes, t_nodes, t_end) -> tuple[int, int, float]:
    """Validated (x_nodes, t_nodes, t_end) of a Burgers solve; ValueError naming the argument."""
    if not callable(u0):
        raise ValueError(f"u0 must be a vectorised callable of x, got {type(u0).__name__}")
    return (check_int("x_nodes", x_nodes, 2), check_int("t_nodes", t_nodes, 2),
            check_number("t_end", t_end, lo=0.0, lo_open=True, what="a finite number > 0"))


def gauss_means(u0, mid: np.ndarray, half) -> np.ndarray:
    """Means of u0 over the intervals [mid - half, mid + half], elementwise (3-point
    Gauss-Legendre, error O(half^6) for smooth u0); ``half`` a number or an array like ``mid``."""
    xg = mid[None] + half * _GAUSS_X.reshape(-1, *([1] * mid.ndim))
    return (_GAUSS_W @ eval_u0(u0, xg.ravel()).reshape(len(_GAUSS_X), -1)).reshape(mid.shape)


def cell_averages(u0, n_cells: int) -> np.ndarray:
    """(n_cells,) averages of u0 over the n_cells equal cells of [0, 1] (3-point
    Gauss-Legendre on each cell, error O(dx^6))."""
    dx = 1.0 / n_cells
    return gauss_means(u0, (np.arange(n_cells) + 0.5) * dx, 0.5 * dx)


def integrals(u0, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """int_a^b u0 elementwise over arrays of ends a, b (``gauss_means`` on [a, b]): the
    primitive between the fine points of a table."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (b - a) * gauss_means(u0, 0.5 * (a + b), 0.5 * (b - a))


def eval_u0(u0, x: np.ndarray, name: str = "u0") -> np.ndarray:
    """u0(x) as a finite float64 array of the shape of x; ValueError saying what u0 must be."""
    try:
        val = np.asarray(u0(x), dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a vectorised callable of a float64 array x "
                         f"returning real values; calling it failed: {exc}") from None
    if val.ndim == 0:
        val = np.full(x.shape, float(val))
    if val.shape != x.shape:
        raise ValueError(f"{name}(x) must return an array of the shape of x {x.shape}, "
                         f"got {val.shape}")
    if not np.all(np.isfinite(val)):
        raise ValueError(f"{name}(x) must be finite on [0, 1]")
    return val


def solve_burgers(u0, *, x_nodes: int, t_nodes: int, t_end: float = 1 / 3, refine: int = 8,
                  cfl: float = 0.45, return_info: bool = False):
    """Entropy solution of u_t + (u^2/2)_x = 0 on [0, 1] x [0, t_end] sampled on the node grid.

    Args:
        u0: vectorised callable x -> u0(x) (float64 numpy array in, same shape out).
        x_nodes: number of output nodes in x (>= 2), spacing 1 / (x_nodes - 1).
        t_nodes: number of output times (>= 2), t_k = k * t_end / (t_nodes - 1).
        t_end: final time (> 0).
        refine: fine cells per output interval (>= 1); the solver uses
            ``refine * (x_nodes - 1)`` cells of width dx.
        cfl: Courant number in (0, 1]; dt = cfl * dx / max|u|.
        return_info: also return a dict with the discrete diagnostics (see below).

    Returns:
        u: (t_nodes, x_nodes) float64 array; row k is time t_k, column j is x_j. Row 0 = u0(x_j).
        info (only if ``return_info``): dict with
            ``cells`` (t_nodes, n_cells) cell averages at the output times (row 0: the Gauss
            averages of u0), ``dx``, ``x_cells`` (cell centres), ``t`` (output times),
            ``mass`` (t_nodes,) = dx * sum(cells), ``inflow`` / ``outflow`` (t_nodes,) the
            time-integrated numerical fluxes through x = 0 / x = 1 since t = 0 (so that
            mass[k] - mass[0] == inflow[k] - outflow[k] up to round-off), ``n_steps``.

    Raises:
        ValueError: on any invalid argument.
    """
    x_nodes, t_nodes, t_end = check_burgers_args(u0, x_nodes, t_nodes, t_end)
    refine = check_int("refine", refine, 1)
    cfl = check_number("cfl", cfl, lo=0.0, hi=1.0, lo_open=True,
                       what="a number in (0, 1] (monotone Godunov)")

    n_cells = refine * (x_nodes - 1)
    dx = 1.0 / n_cells
    x_nodes_arr = np.linspace(0.0, 1.0, x_nodes)
    t_out = np.linspace(0.0, t_end, t_nodes)
    x_c = (np.arange(n_cells) + 0.5) * dx

    u = cell_averages(u0, n_cells)

    out = np.empty((t_nodes, x_nodes), dtype=np.float64)
    out[0] = eval_u0(u0, x_nodes_arr)
    cells = np.empty((t_nodes, n_cells), dtype=np.float64) if return_info else None
    inflow = np.zeros(t_nodes)
    outflow = np.zeros(t_nodes)
    if return_info:
        cells[0] = u

    face_idx = np.arange(1, x_nodes - 1) * refine  # fine face index of each interior node
    ext = np.zeros(n_cells + 2)        # ghost | cells | ghost ; left ghost stays 0 (inflow)
    flux = np.empty(n_cells + 1)
    tmp = np.empty(n_cells + 1)
    t = 0.0
    n_steps = 0
    cum_in = cum_out = 0.0
    for k in range(1, t_nodes):
        t_next = t_out[k]
        while t < t_next:
            smax = float(np.max(np.abs(u)))
            dt = cfl * dx / smax if smax > 0.0 else math.inf
            last = t + dt >= t_next - 1e-12 * t_end
            if last:
                dt = t_next - t
            ext[1:-1] = u
            ext[-1] = u[-1]                       # transmissive outflow ghost
            # Godunov flux, in place: 0.5 * max(max(uL,0)^2, min(uR,0)^2)
            np.maximum(ext[:-1], 0.0, out=flux)
            np.square(flux, out=flux)
            np.minimum(ext[1:], 0.0, out=tmp)
            np.square(tmp, out=tmp)
            np.maximum(flux, tmp, out=flux)
            flux *= 0.5
            u -= (dt / dx) * (flux[1:] - flux[:-1])
            cum_in += dt * flux[0]
            cum_out += dt * flux[-1]
            t = t_next if last else t + dt
            n_steps += 1
        out[k, 1:-1] = 0.5 * (u[face_idx - 1] + u[face_idx])
        out[k, 0] = riemann_state(0.0, u[0])
        out[k, -1] = u[-1]
        inflow[k] = cum_in
        outflow[k] = cum_out
        if return_info:
            cells[k] = u

    if not return_info:
        return out
    info = {
        "cells": cells, "dx": dx, "x_cells": x_c, "t": t_out,
        "mass": dx * cells.sum(axis=1), "inflow": inflow, "outflow": outflow,
        "n_steps": n_steps,
    }
    return out, info
