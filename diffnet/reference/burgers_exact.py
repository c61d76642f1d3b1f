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
interval (M fine points y_k = k h, h = 1 / M); the global minimum of G over those fine points
picks the branch; bisection on G'(y) = u0(y) - (x - y) / t in the two fine cells around it
refines the foot to round-off, so u = u0(y*) holds to machine precision off shocks. At a node
exactly on a shock the two minima tie and either one-sided state may be returned.

Finding the fine-grid minimum (``method``):

* ``"hull"`` (default). G(y_k) = phi_k - (x / t) y_k + x^2 / (2 t) with phi_k = U0(y_k) +
  y_k^2 / (2 t), so the minimiser over k of a linear tilt of phi is a vertex of the lower convex
  hull of the points (y_k, phi_k): the vertex where the hull's edge slopes, which increase along
  the hull, cross x / t -- one ``searchsorted`` for all nodes of a time row. The hull of row t_n
  is pruned from the hull of row t_{n-1}: a fine point that is a hull vertex at t (the foot of a
  surviving characteristic) is one at every earlier time (a characteristic that has entered a
  shock never leaves it; algebraically, if y_k is the foot at (x, t), it is the unique foot at
  (y_k + (x - y_k) s / t, s) for s < t), so the vertex sets shrink with t and every fine point is
  removed at most once over the whole solve. Pruning = deleting points on or above the chord of
  their neighbours until none is left: vectorised deletion passes while many are, then a
  sequential work list (a point's deletion can only make its two neighbours deletable). Cost
  per sample: O(N_t * M) vectorised numpy work (one convexity test and one slope per hull
  vertex per row), a few Python steps per deleted point (at most M deletions in all), and the
  bisection, O(N_t * N_x * log2(h / ulp)) -- against O(N_t * N_x * M) for the brute force,
  which is why the hull is the default: at M = 64 (N - 1) fine points the brute force is two
  orders of magnitude slower at 1024^2 (lab/notes/readme-second-release.md); most of the hull's
  time is the bisection.
* ``"brute"``: G at every fine point y_k <= x for every node (kept as the check of the hull).

Both agree on the fine-grid index except where two candidates tie within round-off: at a shock
through a node (either one-sided state, as above), or two neighbouring fine points (the
bisection then finds the same root from either). Conditioning: phi itself is never formed
(y^2 / (2 t) ~ 1 / t would swamp U0 at small t); hull tests and slopes use chord slopes of U0
and the exact integer indices (see ``_convexity`` and ``_tilt_keys``).
"""
from __future__ import annotations

import numpy as np

from diffnet.validation import check_choice, check_int
from diffnet.reference.burgers import cell_averages, check_burgers_args, eval_u0, integrals

__all__ = ["solve_burgers_exact", "exact_cell_averages"]

METHODS = ("hull", "brute")
_CHUNK = 1 << 22      # brute force: candidate evaluations held at once (32 MiB of float64)
_BLOCK = 1 << 16      # nodes refined together by the (vectorised) bisection
_BULK = 256           # vectorised deletion pass while more than 1 point in _BULK is deletable


def _primitive(u0, n_cells: int) -> tuple[np.ndarray, np.ndarray]:
    """(y, U0(y)) on the fine grid y_k = k / n_cells, k = 0..n_cells."""
    cell = (1.0 / n_cells) * cell_averages(u0, n_cells)
    return np.linspace(0.0, 1.0, n_cells + 1), np.concatenate([[0.0], np.cumsum(cell)])


def _brute_index(x: np.ndarray, t: float, y: np.ndarray, big_u0: np.ndarray) -> np.ndarray:
    """Fine index of the smallest G(y_k) over y_k <= x, for every node x (first on ties)."""
    best = np.empty(x.size, dtype=np.int64)
    step = max(1, _CHUNK // y.size)
    for lo in range(0, x.size, step):
        xs = x[lo:lo + step, None]
        g = big_u0[None, :] + (xs - y[None, :]) ** 2 / (2.0 * t)
        g[y[None, :] > xs] = np.inf             # u >= 0: the foot lies left of x
        best[lo:lo + step] = np.argmin(g, axis=1)
    return best


def _convexity(k: np.ndarray, uk: np.ndarray, h2t: float) -> np.ndarray:
    """h * (slope(b, c) - slope(a, b)) of phi at each interior point b of the chain k.

    slope(a, b) = (U0_b - U0_a) / ((b - a) h) + (a + b) h / (2 t), so the difference is a
    difference of chord slopes of U0 (bounded by max u0) plus (c - a) h^2 / (2 t), exact in the
    integers: no cancellation of the large y^2 / (2 t) terms. b is a strict hull vertex of
    (a, b, c) iff the value is > 0. (``_repair`` repeats this expression operation for
    operation, so both paths take the same decisions.)
    """
    dk = np.diff(k)
    du = np.diff(uk)
    return du[1:] / dk[1:] - du[:-1] / dk[:-1] + (k[2:] - k[:-2]) * h2t


def _repair(k: np.ndarray, uk: np.ndarray, h2t: float, bad: np.ndarray):
    """Delete the points on or above their neighbours' chord, sequentially from ``bad`` (the
    positions known to be so): a deletion changes the neighbours of two points only, which go
    back on the work list. Ends with every point strictly convex, i.e. the lower hull."""
    n = k.size
    prev: dict[int, int] = {}                   # neighbours, where no longer i - 1 / i + 1
    nxt: dict[int, int] = {}
    dead: set[int] = set()
    work = bad.tolist()
    while work:
        b = work.pop()
        if b in dead or b == 0 or b == n - 1:   # the end points are always vertices
            continue
        a, c = prev.get(b, b - 1), nxt.get(b, b + 1)
        ka, kb, kc = int(k[a]), int(k[b]), int(k[c])
        ua, ub, uc = float(uk[a]), float(uk[b]), float(uk[c])
        if (uc - ub) / (kc - kb) - (ub - ua) / (kb - ka) + (kc - ka) * h2t <= 0.0:
            dead.add(b)
            nxt[a], prev[c] = c, a
            work += [a, c]
    keep = np.ones(n, dtype=bool)
    keep[list(dead)] = False
    return k[keep], uk[keep]


def _lower_hull(k: np.ndarray, uk: np.ndarray, h2t: float):
    """Lower convex hull vertices of the fine points k (sorted) with values uk = U0(y_k).

    Deleting a point on or above the chord of two others never deletes a hull vertex, and
    several can go at once; a concave stretch goes in one vectorised pass, but the convex points
    next to a shock's bridge only become deletable one after the other (Andrew's monotone chain
    pops), which the work list does in O(1) each instead of an O(size) pass each.
    """
    while k.size > 2:
        bad = np.flatnonzero(_convexity(k, uk, h2t) <= 0.0) + 1
        if bad.size * _BULK <= k.size:
            return _repair(k, uk, h2t, bad) if bad.size else (k, uk)
        keep = np.ones(k.size, dtype=bool)
        keep[bad] = False
        k, uk = k[keep], uk[keep]
    return k, uk


def _tilt_keys(k: np.ndarray, uk: np.ndarray, t: float, h: float) -> np.ndarray:
    """t / h * (slope of phi) on each hull edge, in fine-index units: the edge from k_i to
    k_{i+1} lowers G(x) = phi - (x / t) y iff its key < x / h. Increasing along the hull."""
    return (t / (h * h)) * (np.diff(uk) / np.diff(k)) + 0.5 * (k[1:] + k[:-1])


def _refine(u0, x: np.ndarray, t: np.ndarray, y: np.ndarray, best: np.ndarray) -> np.ndarray:
    """Foot y* of each node (arrays of equal shape): bisection on G' around fine point best."""
    dy = y[1] - y[0]
    a = np.maximum(y[best] - dy, 0.0)
    b = np.minimum(y[best] + dy, x)
    da = eval_u0(u0, a) - (x - a) / t
    db = eval_u0(u0, b) - (x - b) / t
    bracket = (da < 0) & (db > 0)               # a root of G' (the minimum) inside [a, b]
    for _ in range(60):
        m = 0.5 * (a + b)
        dm = eval_u0(u0, m) - (x - m) / t
        left = dm > 0
        b_new = np.where(bracket & left, m, b)
        a_new = np.where(bracket & ~left, m, a)
        # (a, b) alone determines the next step, so once a step changes nothing (intervals of
        # one ulp, after ~40 steps) the remaining ones would not either: same result as 60.
        if np.array_equal(a_new, a) and np.array_equal(b_new, b):
            break
        a, b = a_new, b_new
    return np.where(bracket, 0.5 * (a + b), y[best])


def _fine_argmin(x: np.ndarray, times: np.ndarray, y: np.ndarray, big_u0: np.ndarray,
                 oversample: int, method: str, clip: bool = True) -> np.ndarray:
    """(t_nodes, x_nodes) fine index of the minimum of G for every node (row 0 unused)."""
    n_fine = y.size - 1
    h = 1.0 / n_fine
    node_k = np.arange(x.size) * oversample     # fine index of each node: x_j = y_{node_k[j]}
    hull_k, hull_u = np.arange(n_fine + 1), big_u0
    best = np.zeros((times.size, x.size), dtype=np.int64)
    for n in range(1, times.size):
        t = times[n]
        if method == "brute":
            best[n] = _brute_index(x, t, y, big_u0)
            continue
        hull_k, hull_u = _lower_hull(hull_k, hull_u, h * h / (2.0 * t))
        best[n] = hull_k[np.searchsorted(_tilt_keys(hull_k, hull_u, t, h), node_k, side="left")]
        # The foot lies left of the node (the brute force's y <= x) without being imposed: U0 is
        # nondecreasing (u0 >= 0, positive quadrature weights), so for y_k > x, G(y_k) - G(x) =
        # U0(y_k) - U0(x) + (y_k - x)^2 / (2 t) > 0, and x is itself a fine point. The clip
        # only guards against round-off (the tests check that it never acts).
        if clip:
            np.minimum(best[n], node_k, out=best[n])
    return best


def solve_burgers_exact(u0, *, x_nodes: int, t_nodes: int, t_end: float = 1 / 3,
                        oversample: int = 64, method: str = "hull") -> np.ndarray:
    """Entropy solution of u_t + (u^2/2)_x = 0 on [0, 1] x [0, t_end], inflow 0 at x = 0.

    Args:
        u0: vectorised callable x -> u0(x) >= 0 (float64 numpy array in, same shape out).
        x_nodes: output nodes in x (>= 2), spacing 1 / (x_nodes - 1).
        t_nodes: output times (>= 2), t_k = k * t_end / (t_nodes - 1); row 0 is u0 itself.
        t_end: final time (> 0).
        oversample: fine cells per output interval for the primitive and the branch search.
        method: "hull" (lower convex hull per time row, fast) or "brute" (every fine point for
            every node, O(oversample * t_nodes * x_nodes^2)); same result up to round-off ties.

    Returns:
        (t_nodes, x_nodes) float64 array; row k is time t_k, column j is x_j.

    Raises:
        ValueError: on an invalid argument, or u0 < 0 somewhere on [0, 1].
    """
    x_nodes, t_nodes, t_end = check_burgers_args(u0, x_nodes, t_nodes, t_end)
    oversample = check_int("oversample", oversample, 1)
    method = check_choice("method", method, METHODS)
    n_fine = oversample * (x_nodes - 1)
    y, big_u0 = _primitive(u0, n_fine)
    if eval_u0(u0, y).min() < 0:
        raise ValueError("u0 must be >= 0 on [0, 1] for the Lax-Oleinik solution with inflow "
                         "at x = 0 (characteristics would enter through x = 1); use the "
                         "Godunov solver solve_burgers instead")
    x = np.linspace(0.0, 1.0, x_nodes)
    times = np.linspace(0.0, t_end, t_nodes)
    out = np.empty((t_nodes, x_nodes), dtype=np.float64)
    out[0] = eval_u0(u0, x)
    best = _fine_argmin(x, times, y, big_u0, oversample, method)
    rows = max(1, _BLOCK // x_nodes)            # refine blocks of rows at once (1-D u0 calls)
    for lo in range(1, t_nodes, rows):
        hi = min(t_nodes, lo + rows)
        xs = np.broadcast_to(x, (hi - lo, x_nodes)).ravel()
        ts = np.repeat(times[lo:hi], x_nodes)
        feet = _refine(u0, xs, ts, y, best[lo:hi].ravel())
        out[lo:hi] = ((xs - feet) / ts).reshape(hi - lo, x_nodes)
    return out


def exact_cell_averages(u0, *, x_nodes: int, t_nodes: int, t_end: float = 1 / 3,
                        oversample: int = 64) -> np.ndarray:
    """Averages of the entropy solution over each node's cell, exactly: what a perfect
    conservative finite-volume method would hold on the grid of ``solve_burgers_exact``.

    Cells: [x_j - dx/2, x_j + dx/2], halved at x = 0 and x = 1. The Hopf-Lax value function

        w(x, t) = min_y G(y) = U0(y*) + (x - y*)^2 / (2 t) = U0(x - u t) + u^2 t / 2

    has w_x = u, so a cell's average is (w(right face) - w(left face)) / width. w is continuous
    across a shock (both minima of G are equal there), so the state a face on a shock gets does
    not matter. The faces are the midpoints of a solve on the grid with twice the x
    resolution; U0 at the feet is the fine table plus the Gauss-Legendre integral to the foot.
    Row 0 is the averages of u0. Arguments as ``solve_burgers_exact``; (t_nodes, x_nodes).
    """
    x_nodes, t_nodes, t_end = check_burgers_args(u0, x_nodes, t_nodes, t_end)
    oversample = check_int("oversample", oversample, 1)
    half = 2 * x_nodes - 1                        # the nodes and the midpoints between them
    u = solve_burgers_exact(u0, x_nodes=half, t_nodes=t_nodes, t_end=t_end,
                            oversample=max(1, oversample // 2))
    x = np.linspace(0.0, 1.0, half)
    t = np.linspace(0.0, t_end, t_nodes)[:, None]
    feet = np.clip(x - u * t, 0.0, 1.0)           # round-off can put a foot a hair outside
    y, big_u0 = _primitive(u0, oversample * (x_nodes - 1))
    k = np.minimum((feet * (len(y) - 1)).astype(np.int64), len(y) - 2)
    w = big_u0[k] + integrals(u0, y[k], feet) + 0.5 * u * u * t
    faces = np.concatenate([[0], np.arange(1, half - 1, 2), [half - 1]])
    return np.diff(w[:, faces], axis=1) / np.diff(x[faces])
