"""The residual an answer carries: how far a field is from satisfying the problem's discrete
equations, with no reference solve (``Problem.answer_residual``).

Every residual here is a ratio of two norms on the whole grid,

    answer_residual(u) = ||R(u)|| / ||R(u_lift)||,

R the problem's discrete residual and u_lift a boundary lift: the field that holds the
boundary (initial) values and is otherwise zero, or for a problem with non-zero Dirichlet
values that ramps them linearly to zero over one subdomain (below). So the lift reads exactly
1 (for every problem but Poisson's the zero field with its boundary values) and the discrete
solution reads 0 (to rounding). Each sample gets its own number.

* Elliptic families (``elliptic_residual``): R(u) = P^T (b - A u_I), the residual of the
  finite-volume system the reference solver assembles (``diffnet.reference.ReferenceSystem``,
  Dirichlet nodes eliminated, u_I the answer at the free nodes) summed over the nodes of each
  of ``CELLS`` x ``CELLS`` (3-D: ``CELLS``^3) equal subdomains: the net flux out of each
  subdomain minus its source, a conservation check. The interior faces of a subdomain cancel
  in the sum, so grid-scale roughness of the answer, which dominates the nodal residual
  ||b - A u_I|| / ||b|| (an error of wavelength l weighs about (l / h)^2 more there than a
  smooth one: answers within 1-3% of the solution read several times the zero field at
  256x256, docs/answer-check.md), does not swamp the misfit of the answer's amplitude and
  shape, and the number does not grow as the grid is refined. The lift ramps the Dirichlet values of the x-faces (Poisson's u = 1 at
  x = 0) to zero across the first subdomain rather than across one cell: the zero field's jump
  at the wall would put a flux of order 1 / h into the norm (the number would then shrink as
  the grid is refined), and the exact linear lift 1 - x would read 0 for a constant
  coefficient. ``cells=0`` gives the nodal residual over ||b|| (the zero field's, the
  relative residual a linear solver reports).
* Burgers (``characteristic_residual``): R(u) = u - u0(x - u t) at every node, the
  characteristic equation, i.e. the slope of the Lax-Oleinik functional the variational loss
  minimises (``lax_oleinik``), with u0 interpolated from the input's u0 row as that loss does
  (``diffnet.primitive``, the inflow value 0 left of x = 0). The exact entropy solution
  satisfies it at every node; row t = 0 reads u - u0(x) and column x = 0 reads u, so the
  initial and inflow conditions are part of it. It is blind to two errors at a shock: a shock
  one node off (each node holds a value of one side) and a value between the two states on
  the middle branch of the characteristics that cross there. A smooth error is seen.

``flags(residuals, threshold)``: True where an answer's residual is above the threshold (or is
not finite), as ``Problem.check_answers`` applies it. A family without a residual of its own
has the one derived from its loss (:mod:`.loss_residual`).
"""
from __future__ import annotations

import numpy as np
import torch

from diffnet.primitive import node_primitive, primitive_with_slope
from diffnet.validation import grid_axes

# Subdomains per axis of the elliptic residual: 4 x 4 (3-D 4^3) separated the good from the
# bad answers of the Darcy benchmark model widest (docs/answer-check.md).
CELLS = 4


def _as_float64(a) -> np.ndarray:
    """``a`` (numpy or torch) as a float64 numpy array."""
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu().to(torch.float64).numpy()
    return np.asarray(a, dtype=np.float64)


def answers_and_inputs(problem, u, inputs) -> tuple[np.ndarray, np.ndarray]:
    """(u (B, *grid), inputs (B, C, *grid)) as float64 on the problem's whole grid; u may
    carry the channel axis of one field (B, 1, *grid). ValueError naming the shapes."""
    u, x = _as_float64(u), _as_float64(inputs)
    if u.ndim == len(problem.grid) + 2 and u.shape[1] == 1:
        u = u[:, 0]
    want = (len(problem.input_channels), *problem.grid)
    if u.shape[1:] != tuple(problem.grid) or x.shape[1:] != want or len(x) != len(u):
        axes = grid_axes(len(problem.grid))
        raise ValueError(f"problem {problem.name!r} checks answers u (B, {axes}) = (B, "
                         f"{', '.join(map(str, problem.grid))}) against inputs (B, C, {axes}) "
                         f"= (B, {', '.join(map(str, want))}), the same B; got u {u.shape} and "
                         f"inputs {x.shape}")
    return u, x


def subdomain_sums(field: np.ndarray, cells: int) -> np.ndarray:
    """Sums of a node field over ``cells`` equal runs of nodes per axis (fewer on an axis with
    fewer nodes): ``cells``^d sums."""
    for axis, n in enumerate(field.shape):
        starts = np.linspace(0, n, min(cells, n) + 1).round().astype(int)[:-1]
        field = np.add.reduceat(field, starts, axis=axis)
    return field


def elliptic_residual(problem, u, inputs, cells: int = CELLS) -> np.ndarray:
    """(B,) ||P^T (b - A u_I)|| / ||P^T (b - A lift_I)|| of each answer: A, b the reference
    solver's finite-volume system (``problem.system_nu``) of the sample's diffusivity (input
    channel "nu"), P^T the sums over ``cells`` subdomains per axis; ``cells=0``: the nodal
    ||b - A u_I|| / ||b||."""
    u, x = answers_and_inputs(problem, u, inputs)
    nu = x[:, problem.input_channels.index("nu")]
    out = np.empty(len(u))
    for i, (n, v) in enumerate(zip(nu, u)):
        system = problem.system_nu(n)
        free = system.free
        r, r0 = np.zeros(v.shape), np.zeros(v.shape)
        r[free] = system.b - system.a @ v[free]
        if cells:
            r0[free] = system.b - system.a @ ramp_lift(problem, system.u_full, cells)[free]
            r, r0 = subdomain_sums(r, cells), subdomain_sums(r0, cells)
        else:
            r0[free] = system.b
        out[i] = np.linalg.norm(r) / np.linalg.norm(r0)
    return out


def ramp_lift(problem, u_full: np.ndarray, cells: int) -> np.ndarray:
    """The Dirichlet values of the first and last x-faces of ``u_full`` (the last axis),
    ramped linearly to zero over 1 / ``cells`` of the domain's length."""
    ax = problem.axes[-1]
    x = (problem.coords()[ax.name] - ax.lo) / (ax.hi - ax.lo)
    lo, hi = np.clip(1 - cells * x, 0, 1), np.clip(1 - cells * (1 - x), 0, 1)
    return u_full[..., :1] * lo + u_full[..., -1:] * hi


def characteristic_residual(problem, u, inputs) -> np.ndarray:
    """(B,) ||u - u0(x - u t)|| / ||u0(x)|| over every node (t, x) of each answer (the
    denominator is R of the field that is u0 at t = 0 and 0 elsewhere, over the rows t > 0).
    ``problem`` has axes (t, x) with t from 0 and the input channel "u0"."""
    u, x = answers_and_inputs(problem, u, inputs)
    dt, dx = problem.spacing
    u0 = torch.from_numpy(x[:, problem.input_channels.index("u0"), 0, :])      # (B, W)
    big = node_primitive(u0, dx)
    c = problem.coords()
    tt = torch.from_numpy(c[problem.axes[0].name] - problem.axes[0].lo)[None, :, None]
    xx = torch.from_numpy(c[problem.axes[1].name] - problem.axes[1].lo)[None, None, :]
    v = torch.from_numpy(u)
    finite = torch.isfinite(v).flatten(1).all(dim=1)
    v = torch.where(torch.isfinite(v), v, 0.0)     # a NaN foot has no cell to look up
    _, foot_value = primitive_with_slope(big, u0, dx, xx - v * tt)
    r = (v - foot_value).flatten(1).norm(dim=1)
    zero = u0.norm(dim=1) * np.sqrt(problem.grid[0] - 1)
    return torch.where(finite, r / zero, torch.nan).numpy()


def flags(residuals, threshold: float | None) -> np.ndarray:
    """(B,) bool: the residual is above ``threshold`` or not finite (a NaN answer is flagged);
    ``threshold`` None: only the non-finite ones (no threshold to compare with)."""
    r = np.asarray(residuals, dtype=np.float64)
    if threshold is None:
        return ~np.isfinite(r)
    return ~(r <= float(threshold))

