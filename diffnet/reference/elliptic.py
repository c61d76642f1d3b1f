"""Classical reference solver for variable-diffusivity (reaction-)diffusion on a rectangle or a
box (numpy/scipy/pyamg), one implementation for 2-D and 3-D node grids.

Equation on [0, Ly] x [0, Lx] (arrays (H, W), rows = y, columns = x) or [0, Lz] x [0, Ly] x
[0, Lx] (arrays (D, H, W), axes (z, y, x))::

    -div(nu grad u) + kappa^2 u = f

with one of two boundary conditions:

* ``dirichlet="poisson"``: u = 1 on x = 0 (index [..., 0]), u = 0 on x = Lx ([..., -1]), zero
  flux nu du/dn = 0 (the natural condition) on every other face (y = 0, Ly; in 3-D also z = 0,
  Lz). With the defaults kappa = 0, f = 0 this is the variable-diffusivity Poisson problem
  div(nu grad u) = 0.
* ``dirichlet="all_zero"``: u = 0 on the whole boundary (reaction-diffusion with source f).

Discretisation: vertex-centred finite volumes on the node grid (spacing h_a = L_a / (n_a - 1)
per axis), the 5-point (3-D: 7-point) scheme in flux form. Each node owns the box of half-widths
h_a / 2 clipped to the domain (half cells on the boundary faces, quarter cells on edges, ...,
so the Neumann faces need nothing else). The flux through the face between neighbours a, b
along an axis of spacing h is nu_ab (u_b - u_a) / h times the face's measure (the product of
the transverse control-volume widths), with the face diffusivity nu_ab the *harmonic* mean
2 nu_a nu_b / (nu_a + nu_b) by default (``face_mean="arithmetic"``: (nu_a + nu_b) / 2). The
reaction and the source are lumped: (kappa^2 u - f) at the node times the control volume.
Dirichlet nodes are eliminated (moved to the right-hand side). The matrix is symmetric positive
definite (an M-matrix: discrete maximum principle).

Accuracy: second order (O(h^2) nodal error) for smooth nu, u and f. Exact to rounding when the
solution is exact for the scheme: a constant nu gives u = 1 - x / Lx; nu = nu(x) gives a
solution of x alone, u(x_j) = 1 - S_j / S, S_j the sum of h / nu_face over the faces left of
x_j: the exact u(x) = 1 - int_0^x 1/nu / int_0^Lx 1/nu whenever 1/nu is linear between
neighbouring nodes (harmonic face = trapezoid rule on 1/nu; e.g. nu = 1 / (a + b x)).

Linear solvers: ``method="direct"`` (SuperLU ``splu``), ``"amg"`` (pyamg smoothed aggregation
as a preconditioner of conjugate gradients, relative residual ``rtol``, default 1e-10;
RuntimeError if 10 rtol is not reached in ``maxiter`` iterations), ``"auto"``: direct up to
``DIRECT_MAX_UNKNOWNS[dims]`` unknowns (256^2 in 2-D, 16^3 in 3-D), AMG above. In 3-D a direct
factorisation fills in far more than in 2-D (nested-dissection fill ~ n^(4/3), work ~ n^2), so
the crossover comes early (both timed by ``python -m bench.fem_bench --problem poisson3d
--sizes 13,17,24,33``). The AMG setup (``amg_hierarchy``) and the preconditioned CG solve
(``amg_cg``) are also callable apart, so a benchmark can time them separately or reuse one
hierarchy as the preconditioner of another matrix (``python -m bench.fem_bench``).

Refinement (``diffusion_system`` -> :class:`ReferenceSystem`): the assembled system of one
coefficient field, solved by the same AMG-preconditioned CG from a given initial guess (an
approximate answer, e.g. a network's) or from zero, to a relative residual; the hierarchy is
built once and reused, and assembly, setup and solve are timed apart. The stopping test
||b - A x|| <= rtol ||b|| does not depend on the guess, so a warm and a cold start of the same
system stop at the same accuracy.
"""
from __future__ import annotations

import functools
import operator
import time

import numpy as np

from diffnet.validation import (check_array, check_choice, check_int, check_number,
                          check_positive_tuple, grid_axes)

__all__ = ["solve_diffusion", "assemble_diffusion", "DIRECT_MAX_UNKNOWNS", "solve_direct",
           "solve_amg", "amg_hierarchy", "amg_cg", "ReferenceSystem", "diffusion_system"]

# "auto" solves directly up to this many unknowns, by grid dimension (the module docstring)
DIRECT_MAX_UNKNOWNS = {2: 256 * 256, 3: 16 ** 3}
DIRICHLET = ("poisson", "all_zero")
METHODS = ("auto", "direct", "amg")
FACE_MEANS = ("harmonic", "arithmetic")


def check_nodal_nu(nu) -> np.ndarray:
    """nu (the diffusivity at the nodes) as a positive finite float64 array of 2 or 3 axes,
    each of >= 3 nodes (one interior node at least); ValueError naming the shape otherwise."""
    nu = check_array("nu (the diffusivity at the nodes)", nu, positive=True)
    if nu.ndim not in DIRECT_MAX_UNKNOWNS or min(nu.shape) < 3:
        raise ValueError(f"nu must be a 2-D ({grid_axes(2)}) or 3-D ({grid_axes(3)}) array with "
                         f"every axis >= 3 nodes, got shape {nu.shape}")
    return nu


def check_source(f, shape) -> np.ndarray:
    """The source at the nodes: None (zero), a number, or an array of the shape of nu."""
    if f is None:
        return np.zeros(shape)
    form = f"(None, a number or an array of shape ({grid_axes(len(shape))}))"
    f = check_array("f", f, form=form)
    if f.ndim == 0:
        f = np.full(shape, float(f))
    if f.shape != shape:
        raise ValueError(f"f must be None, a number or an array of the shape of nu "
                         f"{shape}, got shape {f.shape}")
    return f


def _check_inputs(nu, lengths, kappa, f, dirichlet, face_mean):
    nu = check_nodal_nu(nu)
    dims = nu.ndim
    if lengths is not None:
        form = "(" + ", ".join(("Lz", "Ly", "Lx")[-dims:]) + ")"
        lengths = check_positive_tuple("lengths", lengths, dims, form)
    kappa = check_number("kappa", kappa, lo=0.0)
    check_choice("dirichlet", dirichlet, DIRICHLET)
    check_choice("face_mean", face_mean, FACE_MEANS)
    return nu, lengths or (1.0,) * dims, kappa, check_source(f, nu.shape)


def _along(v: np.ndarray, axis: int, dims: int) -> np.ndarray:
    """A 1-D array shaped to broadcast along ``axis`` of a ``dims``-axis array."""
    shape = [1] * dims
    shape[axis] = v.size
    return v.reshape(shape)


def _faces(nu, widths, spacing, face_mean):
    """(node a, node b, conductance nu_ab * face measure / h) of every face, the faces along
    the last axis (x) first."""
    dims = nu.ndim
    idx = np.arange(nu.size).reshape(nu.shape)
    pa, pb, cond = [], [], []
    for axis in reversed(range(dims)):
        lo = tuple(slice(None, -1) if k == axis else slice(None) for k in range(dims))
        hi = tuple(slice(1, None) if k == axis else slice(None) for k in range(dims))
        across = functools.reduce(operator.mul, [_along(widths[k], k, dims)
                                                 for k in range(dims) if k != axis])
        a, b = nu[lo], nu[hi]
        face = 2.0 * a * b / (a + b) if face_mean == "harmonic" else 0.5 * (a + b)
        cond.append((face * (across / spacing[axis])).ravel())
        pa.append(idx[lo].ravel())
        pb.append(idx[hi].ravel())
    return np.concatenate(pa), np.concatenate(pb), np.concatenate(cond)


def _dirichlet(shape, dirichlet):
    """(free mask, u_full holding the Dirichlet values) for the boundary condition."""
    free = np.ones(shape, dtype=bool)
    u_full = np.zeros(shape)
    if dirichlet == "poisson":
        free[..., [0, -1]] = False
        u_full[..., 0] = 1.0
    else:
        for axis in range(len(shape)):
            free[tuple([0, -1] if k == axis else slice(None) for k in range(len(shape)))] = False
    return free, u_full


def assemble_diffusion(nu, *, lengths=None, kappa: float = 0.0, f=None,
                       dirichlet: str = "poisson", face_mean: str = "harmonic"):
    """Assemble the reduced finite-volume system A u_I = b (Dirichlet nodes eliminated).

    Returns ``(A, b, free, u_full)``: A is the (n, n) CSR matrix over the free nodes, b the
    right-hand side, ``free`` the boolean mask of unknown nodes (the shape of nu; C order of
    the unknowns) and ``u_full`` an array of that shape holding the Dirichlet values (zero at
    free nodes). Arguments as in :func:`solve_diffusion`.
    """
    nu, lengths, kappa, f = _check_inputs(nu, lengths, kappa, f, dirichlet, face_mean)
    dims, n = nu.ndim, nu.size
    spacing = [length / (m - 1) for length, m in zip(lengths, nu.shape)]
    widths = []           # control-volume widths along each axis: half at the ends
    for m, h in zip(nu.shape, spacing):
        w = np.full(m, h)
        w[[0, -1]] = 0.5 * h
        widths.append(w)
    pa, pb, c = _faces(nu, widths, spacing, face_mean)
    volume = functools.reduce(operator.mul, [_along(w, k, dims) for k, w in enumerate(widths)])
    volume = volume.ravel()
    diag = np.bincount(pa, weights=c, minlength=n) + np.bincount(pb, weights=c, minlength=n)
    diag += kappa ** 2 * volume
    rows = np.concatenate([np.arange(n), pa, pb])
    cols = np.concatenate([np.arange(n), pb, pa])
    vals = np.concatenate([diag, -c, -c])
    import scipy.sparse as sp  # here, not at the top: every process that imports diffnet (a
    # Burgers rank too) would pay scipy.sparse.linalg's import for a solver it never runs

    a_full = sp.csr_matrix((vals, (rows, cols)), shape=(n, n))
    free, u_full = _dirichlet(nu.shape, dirichlet)
    return (*eliminate_dirichlet(a_full, f.ravel() * volume, free, u_full), free, u_full)


def eliminate_dirichlet(a_full, load: np.ndarray, free: np.ndarray, u_full: np.ndarray):
    """(a, b): the system of the free nodes, a = a_full restricted to them (CSR, indices sorted)
    and b = load - a_full[free, fixed] u_fixed (the Dirichlet values moved to the right side);
    ``load`` (n,) the nodal source times the control volumes."""
    fi = np.flatnonzero(free.ravel())
    di = np.flatnonzero(~free.ravel())
    b = load[fi] - a_full[fi][:, di] @ u_full.ravel()[di]
    a = a_full[fi][:, fi].tocsr()
    a.sort_indices()
    return a, b


def solve_direct(a, b):
    """x of the sparse SPD system a x = b by SuperLU (``splu``), and the timing info."""
    import scipy.sparse.linalg as spla  # at first use (see assemble_diffusion)

    t0 = time.perf_counter()
    lu = spla.splu(a.tocsc(), permc_spec="MMD_AT_PLUS_A")
    t1 = time.perf_counter()
    x = lu.solve(b)
    t2 = time.perf_counter()
    return x, {"setup_time": t1 - t0, "solve_time": t2 - t1, "iterations": 0}


def amg_hierarchy(a):
    """The pyamg smoothed-aggregation hierarchy of the SPD matrix ``a`` (the reference solver's
    settings: ``symmetry="symmetric"``, ``max_coarse=500``)."""
    import pyamg

    return pyamg.smoothed_aggregation_solver(a, symmetry="symmetric", max_coarse=500)


def amg_cg(ml, a, b, rtol, maxiter, x0=None):
    """x of the SPD system a x = b by CG preconditioned with one V-cycle of the hierarchy ``ml``
    from the initial guess ``x0`` (None: zero) until ||b - a x|| <= rtol ||b|| or ``maxiter``
    iterations, and the info (``iterations``, ``residual`` = the relative residual reached; no
    error when it is above ``rtol``).

    ``a`` is normally the matrix ``ml`` was built on (then this is ``ml.solve(b, accel="cg")``);
    another SPD matrix of the same size is allowed: ``ml`` is then only its preconditioner."""
    from pyamg.krylov import cg

    residuals: list[float] = []
    x, _ = cg(a, b, x0=x0, tol=rtol, maxiter=maxiter, M=ml.aspreconditioner(cycle="V"),
              residuals=residuals)
    bnorm = float(np.linalg.norm(b))
    rel = float(np.linalg.norm(b - a @ x)) / bnorm if bnorm > 0 else 0.0
    return x, {"iterations": max(len(residuals) - 1, 0), "residual": rel}


def solve_amg(a, b, rtol, maxiter):
    """x of the SPD system a x = b by CG preconditioned with pyamg smoothed aggregation, to the
    relative residual ``rtol`` (RuntimeError above 10 rtol after ``maxiter``), and the info."""
    t0 = time.perf_counter()
    ml = amg_hierarchy(a)
    t1 = time.perf_counter()
    x, info = amg_cg(ml, a, b, rtol, maxiter)
    t2 = time.perf_counter()
    if info["residual"] > 10 * rtol:
        raise RuntimeError(f"AMG-CG did not converge: relative residual {info['residual']:.3e} "
                           f"after {info['iterations']} iterations (rtol {rtol:g})")
    return x, {"setup_time": t1 - t0, "solve_time": t2 - t1,
               "iterations": info["iterations"], "levels": len(ml.levels)}


def solve_diffusion(nu, *, lengths=None, kappa: float = 0.0, f=None,
                    dirichlet: str = "poisson", method: str = "auto",
                    face_mean: str = "harmonic", rtol: float = 1e-10, maxiter: int = 500,
                    return_info: bool = False):
    """Solve -div(nu grad u) + kappa^2 u = f on the node grid of ``nu`` (see module docstring).

    Args:
        nu: (H, W) or (D, H, W) positive diffusivity at the nodes, every axis >= 3 nodes;
            axes (y, x) or (z, y, x), each [0, L].
        lengths: (Ly, Lx) or (Lz, Ly, Lx) domain lengths (> 0); default 1 each.
        kappa: reaction coefficient (>= 0); the equation uses kappa^2.
        f: source, None (zero), a number, or an array of nu's shape at the nodes.
        dirichlet: "poisson" (u = 1 at x = 0, u = 0 at x = Lx, zero flux on the other faces)
            or "all_zero" (u = 0 on the whole boundary).
        method: "direct" (SuperLU), "amg" (pyamg smoothed aggregation + CG) or "auto"
            (direct for <= ``DIRECT_MAX_UNKNOWNS[nu.ndim]`` unknowns, else amg).
        face_mean: face diffusivity, "harmonic" (default) or "arithmetic" mean of the nodes.
        rtol, maxiter: AMG stopping criterion (relative residual) and iteration cap.
        return_info: also return a dict with ``method``, ``n_unknowns``, ``assemble_time``,
            ``setup_time`` (factorisation / AMG hierarchy), ``solve_time``, ``iterations``,
            ``residual`` (relative residual ||b - A u|| / ||b||).

    Returns:
        float64 solution of nu's shape including the boundary nodes (and the info dict if
        asked).
    """
    t0 = time.perf_counter()
    a, b, free, u_full = assemble_diffusion(nu, lengths=lengths, kappa=kappa, f=f,
                                            dirichlet=dirichlet, face_mean=face_mean)
    t_assemble = time.perf_counter() - t0
    check_choice("method", method, METHODS)
    rtol = check_number("rtol", rtol, lo=0.0, hi=1.0, lo_open=True, hi_open=True,
                        what="a number in (0, 1)")
    maxiter = check_int("maxiter", maxiter, 1)
    n = a.shape[0]
    if method == "auto":
        method = "direct" if n <= DIRECT_MAX_UNKNOWNS[free.ndim] else "amg"
    if not np.any(b):
        x, info = np.zeros(n), {"setup_time": 0.0, "solve_time": 0.0, "iterations": 0}
    elif method == "direct":
        x, info = solve_direct(a, b)
    else:
        x, info = solve_amg(a, b, rtol, maxiter)
    u = u_full.copy()
    u[free] = x
    if not return_info:
        return u
    bnorm = float(np.linalg.norm(b))
    info.update(method=method, n_unknowns=n, assemble_time=t_assemble,
                residual=float(np.linalg.norm(b - a @ x)) / bnorm if bnorm > 0 else 0.0)
    return u, info


class ReferenceSystem:
    """The assembled system of one sample (``assemble_diffusion``'s ``(a, b, free, u_full)``),
    solved by AMG-preconditioned CG from any initial guess.

    ``refine(u0, rtol)`` returns the full field at relative residual ``rtol`` and its info; the
    AMG hierarchy is built on the first call and reused, so a warm start (``u0`` an approximate
    answer) and a cold start (``u0=None``: zero at the free nodes) run on the same hierarchy to
    the same stopping test. ``assemble_time`` and ``setup_time`` (the hierarchy's) are kept apart
    from each call's ``solve_time``."""

    def __init__(self, a, b, free, u_full, assemble_time: float = 0.0):
        self.a, self.b, self.free, self.u_full = a, b, free, u_full
        self.assemble_time = float(assemble_time)
        self.setup_time = 0.0
        self.ml = None

    @property
    def n_unknowns(self) -> int:
        return int(self.a.shape[0])

    def hierarchy(self):
        """The AMG hierarchy of the matrix, built (and timed) on the first call."""
        if self.ml is None:
            t0 = time.perf_counter()
            self.ml = amg_hierarchy(self.a)
            self.setup_time = time.perf_counter() - t0
        return self.ml

    def residual(self, u) -> float:
        """||b - A u_free|| / ||b|| of a full field ``u`` (its Dirichlet nodes are not read);
        nan when u has non-finite values at the free nodes."""
        x = self.free_values(u)
        bnorm = float(np.linalg.norm(self.b))
        r = float(np.linalg.norm(self.b - self.a @ x))
        return r / bnorm if bnorm > 0 else r

    def free_values(self, u) -> np.ndarray:
        """The free nodes of a full field ``u`` as float64; ValueError naming the shape."""
        u = np.asarray(u, dtype=np.float64)
        if u.shape != self.free.shape:
            raise ValueError(f"the field must have the problem's grid shape {self.free.shape}, "
                             f"got shape {u.shape}")
        return u[self.free]

    def guess(self, u0) -> np.ndarray:
        """The initial guess of a solve: the free nodes of a full field ``u0`` (zero for None);
        ValueError naming the shape or the non-finite values otherwise."""
        if u0 is None:
            return np.zeros(self.n_unknowns)
        x = self.free_values(u0)
        if not np.all(np.isfinite(x)):
            raise ValueError(f"the initial guess has {int(np.sum(~np.isfinite(x)))} non-finite "
                             f"values (NaN or inf): it cannot start the solver")
        return x

    def refine(self, u0, rtol: float, maxiter: int = 500):
        """(u, info): the full field solving the system to ||b - A x|| <= rtol ||b||, started
        from the full field ``u0`` (None: a cold start from zero). info: ``iterations``,
        ``residual`` (reached), ``initial_residual`` (of the guess), ``converged`` (residual <=
        rtol; no error otherwise), ``warm``, ``solve_time``, ``setup_time``, ``assemble_time``,
        ``n_unknowns``."""
        rtol = check_number("the refinement tolerance", rtol, lo=0.0, hi=1.0, lo_open=True,
                            hi_open=True, what="a relative residual in (0, 1)")
        maxiter = check_int("maxiter", maxiter, 1)
        x0 = self.guess(u0)
        ml = self.hierarchy()
        r0 = self.residual(u0) if u0 is not None else 1.0     # ||b - A 0|| / ||b||
        t0 = time.perf_counter()
        x, info = amg_cg(ml, self.a, self.b, rtol, maxiter, x0=x0)
        solve_time = time.perf_counter() - t0
        u = self.u_full.copy()
        u[self.free] = x
        info.update(initial_residual=r0, converged=info["residual"] <= rtol,
                    warm=u0 is not None, solve_time=solve_time, setup_time=self.setup_time,
                    assemble_time=self.assemble_time, n_unknowns=self.n_unknowns)
        return u, info


def diffusion_system(nu, *, lengths=None, kappa: float = 0.0, f=None,
                     dirichlet: str = "poisson", face_mean: str = "harmonic") -> ReferenceSystem:
    """The :class:`ReferenceSystem` of ``solve_diffusion``'s problem (same arguments), its
    assembly timed."""
    t0 = time.perf_counter()
    parts = assemble_diffusion(nu, lengths=lengths, kappa=kappa, f=f, dirichlet=dirichlet,
                               face_mean=face_mean)
    return ReferenceSystem(*parts, assemble_time=time.perf_counter() - t0)
