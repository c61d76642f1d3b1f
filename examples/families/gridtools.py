"""What the four families of this directory share, written with the public API only.

* node fields of a draw: zero-mean cosine modes (a log-normal coefficient, a source); the
  node coordinates and the bubble, prod 4 t (1 - t), zero on every wall (the lift's factor and
  the networks' yardstick), are the contract's ``diffnet.problems.mesh`` and ``bubble``;
* the residual's pieces in torch, with the split-exact stencil ``FiniteDifference(u, block)``:
  the flux form of -div(a grad u) and the Laplacian;
* the same stencils as scipy sparse matrices on the whole node grid, and the Dirichlet solve
  that eliminates the boundary nodes (u = g there) and solves for the interior ones;
* ``ResidualFamily``, the part of a ``Problem`` the four families have alike: the loss, the
  squared ``residual`` on the interior nodes, and the reference solver of the same scheme.

Every operator here is second order and uses only a node's 3^dims neighbours, so on the
interior nodes the torch residual and the sparse rows are the same formula (a family's test
checks it to rounding). Axis order is the grid's: (y, x) in 2-D, (z, y, x) in 3-D.
"""
from __future__ import annotations

import abc
import functools

import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as spla
import torch

from diffnet.problems import Problem, operator_norm, residual_energy, residual_norm


def interval(name: str, value) -> tuple[float, float]:
    """An option (lo, hi) as two floats with lo < hi; ValueError naming the option otherwise."""
    lo, hi = (float(v) for v in value)
    if not lo < hi:
        raise ValueError(f"{name} must be (lo, hi) with lo < hi, got {value}")
    return lo, hi


# -- node fields of a draw ----------------------------------------------------------------------
def cosine_modes(points, modes) -> np.ndarray:
    """(len(modes), *grid): prod over axes of cos(k pi t) for each wave-number tuple of
    ``modes`` (one entry per axis of ``points``). A tuple with a non-zero entry gives a
    zero-mean field on the nodes (no constant part for instance norm to erase)."""
    return np.stack([functools.reduce(np.multiply, (np.cos(k * np.pi * t)
                                                    for k, t in zip(wave, points)))
                     for wave in modes])


def combine(params, fields) -> np.ndarray:
    """(n, *grid): each row of ``params`` (n, k) times the k ``fields`` (k, *grid), summed."""
    return np.tensordot(np.asarray(params, dtype=np.float64), fields, axes=1)


# -- the residual's pieces, split-exact (torch) ----------------------------------------------------
def second_channels(fd) -> list[int]:
    """The output channels of ``fd`` (a FiniteDifference) that are pure second derivatives."""
    return [i for i, d in enumerate(fd.derivatives) if len(d) == 2 and d[0] == d[1]]


def laplacian(fd, block, t) -> torch.Tensor:
    """(B, 1, *shape) the central Laplacian of t (B, 1, *shape) on ``block``."""
    return fd(t, block)[:, second_channels(fd)].sum(1, keepdim=True)


def flux_divergence(fd, block, u, a) -> torch.Tensor:
    """(B, 1, *shape) -div(a grad u) in flux form with arithmetic face means,
    -sum over axes of [a_{i+1/2} (u_{i+1} - u_i) - a_{i-1/2} (u_i - u_{i-1})] / h^2, on the
    interior nodes. Written with the central Laplacian L, which the split stencil gives:
    per axis the bracket is a_i L u + L(a u) - u_i L a (times h^2 / 2), an identity.
    u and a are (B, 1, *shape); the three Laplacians come from one stencil call."""
    n = u.shape[0]
    lap = laplacian(fd, block, torch.cat([u, a * u, a.expand_as(u)]))
    return -0.5 * (a * lap[:n] + lap[n:2 * n] - u * lap[2 * n:])


# -- the same stencils as sparse matrices (scipy) ---------------------------------------------------
def first_difference(n: int, h: float) -> sp.csr_matrix:
    """(n, n) central first difference (u_{i+1} - u_{i-1}) / 2h; rows 0 and n-1 are cut
    (only interior rows are ever used)."""
    return sp.diags([-1.0, 1.0], [-1, 1], (n, n), format="csr") / (2 * h)


def second_difference(n: int, h: float) -> sp.csr_matrix:
    """(n, n) central second difference (u_{i+1} - 2 u_i + u_{i-1}) / h^2 (interior rows)."""
    return sp.diags([1.0, -2.0, 1.0], [-1, 0, 1], (n, n), format="csr") / h**2


def along(mat, axis: int, grid) -> sp.csr_matrix:
    """The 1-D operator ``mat`` (m, n) applied along grid ``axis`` of the flattened (C-order)
    grid; m may differ from n (nodes to faces)."""
    eye = [sp.identity(n, format="csr") for n in grid]
    eye[axis] = sp.csr_matrix(mat)
    return functools.reduce(lambda x, y: sp.kron(x, y, format="csr"), eye)


def flux_operator(a: np.ndarray, spacing) -> sp.csr_matrix:
    """(N, N) -div(a grad .) in flux form with arithmetic face means, a the nodal coefficient
    (*grid): sum over axes of G^T diag(a_face) G / h^2, G the node-to-face difference. On the
    interior rows it is ``flux_divergence``; symmetric, positive on the interior block."""
    grid, out = a.shape, 0
    for axis, h in enumerate(spacing):
        n = grid[axis]
        g = along(sp.diags([-1.0, 1.0], [0, 1], (n - 1, n)), axis, grid)   # node -> face
        face_a = 0.5 * abs(g) @ a.ravel()
        out = out + g.T @ sp.diags(face_a) @ g / h**2
    return sp.csr_matrix(out)


def interior_mask(grid) -> np.ndarray:
    """(*grid) bool: the nodes off every wall."""
    mask = np.zeros(grid, dtype=bool)
    mask[(slice(1, -1),) * len(grid)] = True
    return mask


def dirichlet_solve(a: sp.spmatrix, f: np.ndarray, g: np.ndarray,
                    symmetric: bool = False) -> np.ndarray:
    """(*grid) float64: u = g on the walls and A u = f on the interior rows of the whole-grid
    operator ``a`` (N, N), f and g given on every node. The boundary columns go to the right
    side; the interior block is solved directly, or, ``symmetric`` and 3-D, by conjugate
    gradients with an algebraic multigrid preconditioner (pyamg) to 1e-13 (a direct
    solve of a 3-D grid fills in)."""
    grid = f.shape
    inner = interior_mask(grid).ravel()
    a = sp.csr_matrix(a)
    u = np.array(g, dtype=np.float64).ravel()
    rhs = np.asarray(f, dtype=np.float64).ravel()[inner] - a[inner][:, ~inner] @ u[~inner]
    block = a[inner][:, inner].tocsc()
    if symmetric and len(grid) == 3:
        u[inner] = _amg_cg(block, rhs)
    else:
        u[inner] = spla.spsolve(block, rhs)
    return u.reshape(grid)


def _amg_cg(a, rhs, rtol: float = 1e-13) -> np.ndarray:
    """CG on a symmetric positive definite ``a``, preconditioned by classical (Ruge-Stuben)
    algebraic multigrid; RuntimeError unless the relative residual reaches ``rtol``."""
    import pyamg

    residuals: list = []
    x = pyamg.ruge_stuben_solver(sp.csr_matrix(a)).solve(rhs, tol=rtol, accel="cg", maxiter=200,
                                                         residuals=residuals)
    if not residuals[-1] <= rtol * residuals[0]:
        raise RuntimeError(f"the 3-D reference solve stopped at a relative residual of "
                           f"{residuals[-1] / residuals[0]:.1e}, not {rtol:.0e}")
    return x


# -- the loss and the reference solver the families share -----------------------------------------
class ResidualFamily(Problem):
    """A family trained on its squared strong-form residual, with a reference solver of the
    same scheme. A subclass gives ``residual(u, inputs)`` (torch, split-exact: r at every node
    of the block) and, for one sample's inputs x (C, *grid) in numpy, ``operator(x)`` (the
    scheme without the source, (N, N) on the whole grid), ``source(x)`` and ``boundary(x)``
    (the Dirichlet data, default 0; nodal fields, only the walls' values are read)."""

    loss_term_names = ("pde",)
    symmetric = False          # True: the operator is symmetric positive definite (3-D: AMG-CG)
    NORMS = ("l2", "multilevel", "operator", "vcycle", "energy")

    def __init__(self, *, grid, norm: str = "l2"):
        super().__init__(grid=grid)
        if norm not in self.NORMS:
            raise ValueError(f"norm must be one of {list(self.NORMS)}, got {norm!r}")
        self.norm = norm
        self.energy_checked = False    # norm "energy": the operator's symmetry probed once

    def config(self) -> dict:
        return {**super().config(), "norm": self.norm}

    @abc.abstractmethod
    def residual(self, u, inputs) -> torch.Tensor:
        """(B, 1, *block) the scheme's residual at every node of the block."""

    @abc.abstractmethod
    def operator(self, x: np.ndarray) -> sp.spmatrix:
        """(N, N) the scheme of ``residual`` without the source, on the whole grid."""

    @abc.abstractmethod
    def source(self, x: np.ndarray) -> np.ndarray:
        """(*grid) the right-hand side at the nodes."""

    def boundary(self, x: np.ndarray) -> np.ndarray:
        """(*grid) a field holding the Dirichlet data on the walls: here u = 0."""
        return np.zeros(self.grid)

    def norm_options(self, inputs) -> dict:
        """The operator's coefficients ``residual_norm`` weighs the levels by (norm
        "operator"): ``coefficient``, ``reaction``, ``advection``; default none."""
        return {}

    def loss_terms(self, u, inputs):
        # the walls hold g exactly, so only the interior nodes' residual counts
        r = self.residual(u, inputs)
        if self.norm == "multilevel":
            return {"pde": residual_norm(r, self)}
        if self.norm == "operator":
            return {"pde": residual_norm(r, self, **self.norm_options(inputs))}
        if self.norm in ("vcycle", "energy"):          # both need the operator symmetric
            at_zero = self.residual(torch.zeros_like(u), inputs)   # r is affine in u
            apply = lambda v: self.residual(v, inputs) - at_zero     # noqa: E731
            if self.norm == "vcycle":    # a V-cycle of the scheme's own operator
                return {"pde": operator_norm(r, self, apply)}
            checked, self.energy_checked = self.energy_checked, True  # the energy, gradient r
            return {"pde": residual_energy(r, u, self, apply, check=not checked)}
        return {"pde": self.mean(r.square(), interior=1)}

    def reference_solution(self, params, method: str = "auto") -> np.ndarray:
        x = self.build_input(np.atleast_2d(params), torch.float64)[0].numpy()
        return self.solve_from_inputs(x, method)

    def solve_from_inputs(self, inputs, method: str = "auto") -> np.ndarray:
        self.check_method(method, from_inputs=True)
        x = self.check_sample(inputs)
        return dirichlet_solve(self.operator(x), self.source(x), self.boundary(x),
                               symmetric=self.symmetric)
