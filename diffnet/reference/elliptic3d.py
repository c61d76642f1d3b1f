"""Classical reference solver for variable-diffusivity (reaction-)diffusion on a 3-D box
(numpy/scipy/pyamg): the 3-D counterpart of ``elliptic.py``.

Equation on the box [0, Lz] x [0, Ly] x [0, Lx], arrays (D, H, W) with axes (z, y, x)::

    -div(nu grad u) + kappa^2 u = f

with one of two boundary conditions:

* ``dirichlet="poisson"``: u = 1 on x = 0 (index [..., 0]), u = 0 on x = Lx ([..., -1]), zero
  flux nu du/dn = 0 (the natural condition) on the four faces y = 0, Ly and z = 0, Lz. With the
  defaults kappa = 0, f = 0 this is the generalised Poisson problem div(nu grad u) = 0.
* ``dirichlet="all_zero"``: u = 0 on all six faces.

Discretisation: vertex-centred finite volumes on the node grid (spacing h_a = L_a / (n_a - 1)
per axis), the 7-point scheme in flux form. Each node owns the box of half-widths h_a / 2
clipped to the domain (half cells on faces, quarter cells on edges, eighth cells at corners,
so the Neumann faces need nothing else). The flux through the face between neighbours a, b
along an axis of spacing h is nu_ab (u_b - u_a) / h times the face area (the product of the two
transverse control-volume widths), nu_ab the *harmonic* mean 2 nu_a nu_b / (nu_a + nu_b) by
default (``face_mean="arithmetic"``: (nu_a + nu_b) / 2). Reaction and source are lumped:
(kappa^2 u - f) at the node times the control volume. Dirichlet nodes are eliminated; the
matrix is symmetric positive definite (an M-matrix: discrete maximum principle).

Accuracy: second order (O(h^2) nodal error) for smooth nu, u and f. Exact to rounding when the
solution is exact for the scheme: a constant nu gives u = 1 - x / Lx; nu = nu(x) gives a
solution of x alone, u(x_j) = 1 - S_j / S, S_j the sum of h / nu_face over the faces left of
x_j: the exact u(x) = 1 - int_0^x 1/nu / int_0^Lx 1/nu when h / nu_face equals the integral of
1/nu over each cell, i.e. (harmonic face = trapezoid rule on 1/nu) whenever 1/nu is linear
between neighbouring nodes (e.g. nu = 1 / (a + b x)); second order otherwise.

Linear solvers: ``method="direct"`` (SuperLU ``splu``), ``"amg"`` (conjugate gradients
preconditioned by pyamg smoothed aggregation, stopped at the relative residual ``rtol``,
default 1e-10: measured within 1e-9 of the direct solution up to 33^3 nodes;
RuntimeError if 10 rtol is not reached in ``maxiter`` iterations) and ``"auto"``:
direct up to ``DIRECT_MAX_UNKNOWNS_3D`` = 16^3 unknowns, AMG above. In 3-D a direct
factorisation fills in far more than in 2-D (nested-dissection fill ~ n^(4/3), work ~ n^2), so
the crossover comes early: on small grids the AMG setup dominates and splu is faster, from
about 17^3 nodes AMG-CG is, and the gap widens quickly with the grid (both are timed by
``python -m bench.fem_bench --problem poisson3d --sizes 13,17,24,33``).

``diffusion_system_3d``: the assembled system as an ``elliptic.ReferenceSystem``, refined by
AMG-preconditioned CG from a given initial guess (see ``elliptic``).
"""
from __future__ import annotations

import time

import numpy as np

from ..validation import check_choice, check_number, check_positive_tuple
from .elliptic import (ReferenceSystem, check_nodal_nu, check_source, eliminate_dirichlet,
                       solve_assembled)

__all__ = ["solve_diffusion_3d", "assemble_diffusion_3d", "DIRECT_MAX_UNKNOWNS_3D",
           "diffusion_system_3d"]

DIRECT_MAX_UNKNOWNS_3D = 16 ** 3
DIRICHLET = ("poisson", "all_zero")
FACE_MEANS = ("harmonic", "arithmetic")


def _control_widths(n: int, h: float) -> np.ndarray:
    """(n,) widths of the nodes' control volumes along one axis: h inside, h / 2 at the ends."""
    w = np.full(n, h)
    w[[0, -1]] = 0.5 * h
    return w


def _along(v: np.ndarray, axis: int) -> np.ndarray:
    """A 1-D array shaped to broadcast along ``axis`` of a 3-D array."""
    shape = [1, 1, 1]
    shape[axis] = v.size
    return v.reshape(shape)


def _face_mean(a, b, kind):
    return 2.0 * a * b / (a + b) if kind == "harmonic" else 0.5 * (a + b)


def _faces(nu, widths, spacing, face_mean):
    """(node a, node b, conductance) of every face: nu_ab * area / h along each axis."""
    idx = np.arange(nu.size).reshape(nu.shape)
    pa, pb, cond = [], [], []
    for axis in range(3):
        lo = tuple(slice(None, -1) if k == axis else slice(None) for k in range(3))
        hi = tuple(slice(1, None) if k == axis else slice(None) for k in range(3))
        area = np.ones((1, 1, 1))
        for k in range(3):
            if k != axis:
                area = area * _along(widths[k], k)
        c = _face_mean(nu[lo], nu[hi], face_mean) * area / spacing[axis]
        pa.append(idx[lo].ravel())
        pb.append(idx[hi].ravel())
        cond.append(c.ravel())
    return np.concatenate(pa), np.concatenate(pb), np.concatenate(cond)


def _dirichlet(shape, dirichlet):
    """(free mask, u_full holding the Dirichlet values) for the boundary condition."""
    free = np.ones(shape, dtype=bool)
    u_full = np.zeros(shape)
    if dirichlet == "poisson":
        free[..., [0, -1]] = False
        u_full[..., 0] = 1.0
    else:
        for axis in range(3):
            free[tuple([0, -1] if k == axis else slice(None) for k in range(3))] = False
    return free, u_full


def assemble_diffusion_3d(nu, *, lengths=(1.0, 1.0, 1.0), kappa: float = 0.0, f=None,
                          dirichlet: str = "poisson", face_mean: str = "harmonic"):
    """Assemble the reduced finite-volume system A u_I = b (Dirichlet nodes eliminated).

    Returns ``(A, b, free, u_full)``: A the (n, n) CSR matrix over the free nodes, b the
    right-hand side, ``free`` the (D, H, W) boolean mask of unknown nodes (C order of the
    unknowns) and ``u_full`` a (D, H, W) array holding the Dirichlet values (zero at free
    nodes). Arguments as in :func:`solve_diffusion_3d`.
    """
    nu = check_nodal_nu(nu, 3)
    lengths = check_positive_tuple("lengths", lengths, 3, "(Lz, Ly, Lx)")
    kappa = check_number("kappa", kappa, lo=0.0)
    check_choice("dirichlet", dirichlet, DIRICHLET)
    check_choice("face_mean", face_mean, FACE_MEANS)
    f = check_source(f, nu.shape)
    spacing = [length / (n - 1) for length, n in zip(lengths, nu.shape)]
    widths = [_control_widths(n, h) for n, h in zip(nu.shape, spacing)]
    volume = (_along(widths[0], 0) * _along(widths[1], 1) * _along(widths[2], 2)).ravel()
    pa, pb, c = _faces(nu, widths, spacing, face_mean)
    n = nu.size
    diag = np.bincount(pa, weights=c, minlength=n) + np.bincount(pb, weights=c, minlength=n)
    diag += kappa ** 2 * volume
    rows = np.concatenate([np.arange(n), pa, pb])
    cols = np.concatenate([np.arange(n), pb, pa])
    import scipy.sparse as sp  # at first use, as in elliptic.assemble_diffusion

    a_full = sp.csr_matrix((np.concatenate([diag, -c, -c]), (rows, cols)), shape=(n, n))
    free, u_full = _dirichlet(nu.shape, dirichlet)
    return (*eliminate_dirichlet(a_full, f.ravel() * volume, free, u_full), free, u_full)


def solve_diffusion_3d(nu, *, lengths=(1.0, 1.0, 1.0), kappa: float = 0.0, f=None,
                       dirichlet: str = "poisson", method: str = "auto",
                       face_mean: str = "harmonic", rtol: float = 1e-10, maxiter: int = 500,
                       return_info: bool = False):
    """Solve -div(nu grad u) + kappa^2 u = f on the node grid of ``nu`` (module docstring).

    Args:
        nu: (D, H, W) positive diffusivity at the nodes, D, H, W >= 3; axes (z, y, x).
        lengths: (Lz, Ly, Lx) box lengths (> 0).
        kappa: reaction coefficient (>= 0); the equation uses kappa^2.
        f: source, None (zero), a number, or a (D, H, W) array at the nodes.
        dirichlet: "poisson" (u = 1 at x = 0, u = 0 at x = Lx, zero flux on the y and z
            faces) or "all_zero" (u = 0 on every face).
        method: "direct" (SuperLU), "amg" (pyamg smoothed aggregation + CG) or "auto" (direct
            for <= DIRECT_MAX_UNKNOWNS_3D unknowns, else amg).
        face_mean: face diffusivity, "harmonic" (default) or "arithmetic".
        rtol, maxiter: AMG stopping criterion (relative residual) and iteration cap.
        return_info: also return a dict with ``method``, ``n_unknowns``, ``assemble_time``,
            ``setup_time``, ``solve_time``, ``iterations``, ``residual`` (||b - A u|| / ||b||).

    Returns:
        (D, H, W) float64 solution including the boundary nodes (and the info dict if asked).
    """
    t0 = time.perf_counter()
    a, b, free, u_full = assemble_diffusion_3d(nu, lengths=lengths, kappa=kappa, f=f,
                                               dirichlet=dirichlet, face_mean=face_mean)
    return solve_assembled(a, b, free, u_full, method=method, direct_max=DIRECT_MAX_UNKNOWNS_3D,
                           rtol=rtol, maxiter=maxiter, t_assemble=time.perf_counter() - t0,
                           return_info=return_info)


def diffusion_system_3d(nu, *, lengths=(1.0, 1.0, 1.0), kappa: float = 0.0, f=None,
                        dirichlet: str = "poisson",
                        face_mean: str = "harmonic") -> ReferenceSystem:
    """The ``ReferenceSystem`` of ``solve_diffusion_3d``'s problem (same arguments), its
    assembly timed."""
    t0 = time.perf_counter()
    parts = assemble_diffusion_3d(nu, lengths=lengths, kappa=kappa, f=f, dirichlet=dirichlet,
                                  face_mean=face_mean)
    return ReferenceSystem(*parts, assemble_time=time.perf_counter() - t0)
