"""Shared pieces of the elliptic problems: the KL-type log-normal diffusivity and quadrature.

Diffusivity (Poisson and reaction-diffusion)::

    nu(x, y; omega) = exp( sum_{i=1..m} omega_i * lambda_i * xi_i(x) * eta_i(y) ),
    xi_i(x) = cos(k_i pi x / Lx),   eta_i(y) = cos(l_i pi y / Ly),
    lambda_i = 1 / (1 + k_i^2 + l_i^2).

The modes (k_i, l_i) run over the integer pairs != (0, 0), ordered by frequency k^2 + l^2,
ties broken by k (so (0,1), (1,0), (1,1), (0,2), (2,0), (1,2), (2,1), (2,2), (0,3), ...).
The cosines satisfy the zero-flux condition of the Poisson problem's y-walls (a smooth, even
reflection of the field) and lambda_i decays like an algebraic spectrum, as in a KL expansion of
a smooth covariance. Every mode has amplitude <= 1, so

    |log nu| <= max|omega| * sum_i lambda_i,

and the bound is attained at a domain corner (all cosines are +-1 there). With omega in [-3, 3]:
m = 4 gives sum lambda = 1/2 + 1/2 + 1/3 + 1/5 = 1.533, |log nu| <= 4.6, nu in [0.010, 99.5];
m = 6 gives sum lambda = 1.9, |log nu| <= 5.7, nu in [0.0033, 299] (`log_nu_bound`). Typical samples are much
milder (the terms rarely align), but the family does contain contrasts of 10^4.

Quadrature: ``trapezoid_weights`` gives the nodal weights of the composite trapezoidal rule on the
node grid (boundary nodes half, corners a quarter), normalised by the domain area so that a
weighted sum is the *mean* of the integrand (O(1), independent of the grid size).
"""
from __future__ import annotations

import abc
import math

import numpy as np
import torch

from ..stencils import KINDS, FiniteDifference, check_block_sizes
from ..validation import check_array, check_choice, check_int, check_range
from .base import Axis, Problem
from .blocks import owned_edges


def kl_modes(n_terms: int) -> list[tuple[int, int]]:
    """The first ``n_terms`` frequency pairs (k, l) (k along x, l along y), by k^2 + l^2 then k."""
    n = int(math.isqrt(int(n_terms))) + 2
    pairs = [(k, l) for k in range(n + 1) for l in range(n + 1) if (k, l) != (0, 0)]
    pairs.sort(key=lambda p: (p[0] ** 2 + p[1] ** 2, p[0]))
    return pairs[:n_terms]


def kl_eigenvalues(n_terms: int) -> np.ndarray:
    """lambda_i = 1 / (1 + k_i^2 + l_i^2) of the first ``n_terms`` modes."""
    return np.array([1.0 / (1.0 + k * k + l * l) for k, l in kl_modes(n_terms)])


def log_diffusivity(omega: np.ndarray, y: np.ndarray, x: np.ndarray,
                    lengths=(1.0, 1.0)) -> np.ndarray:
    """log nu on the node grid: omega (n, m) -> (n, len(y), len(x)) float64."""
    omega = np.asarray(omega, dtype=np.float64)
    m = omega.shape[1]
    ly, lx = lengths
    modes = kl_modes(m)
    lam = kl_eigenvalues(m)
    # basis (m, H, W): lambda_i * cos(l pi y) cos(k pi x)
    basis = np.stack([lam[i] * np.outer(np.cos(l * np.pi * np.asarray(y) / ly),
                                        np.cos(k * np.pi * np.asarray(x) / lx))
                      for i, (k, l) in enumerate(modes)])
    return np.tensordot(omega, basis, axes=(1, 0))


def log_nu_bound(n_terms: int, omega_range) -> float:
    """max |log nu| over the family (attained at a corner)."""
    return float(max(abs(omega_range[0]), abs(omega_range[1])) * kl_eigenvalues(n_terms).sum())


def trapezoid_weights(grid, dtype=torch.float64) -> torch.Tensor:
    """(H, W) trapezoidal nodal weights normalised to sum to 1 (boundary 1/2, corners 1/4)."""
    h, w = grid
    wr = torch.ones(h, dtype=torch.float64)
    wr[0] = wr[-1] = 0.5
    wc = torch.ones(w, dtype=torch.float64)
    wc[0] = wc[-1] = 0.5
    out = torch.outer(wr / (h - 1), wc / (w - 1))
    return out.to(dtype)


def edge_weights(n: int) -> torch.Tensor:
    """(n,) 1-D trapezoidal weights normalised to sum to 1 (the two end nodes get half)."""
    wv = torch.full((n,), 1.0 / (n - 1), dtype=torch.float64)
    wv[0] = wv[-1] = 0.5 / (n - 1)
    return wv


def harmonic_mean(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """2ab / (a + b), the face diffusivity of two positive nodal values."""
    return 2.0 * a * b / (a + b)


# ----------------------------------------------------------------------------------------------
# Shared base of the two elliptic families (diffusivity sampling, inputs, energy quadrature).
# ----------------------------------------------------------------------------------------------

QUADRATURES = ("faces", "nodes")


class DiffusivityInputs:
    """Inputs and reference of a problem whose coefficient is a diffusivity nu > 0 at the
    nodes, for any number of axes. The class gives ``log_nu(params)`` (n, *grid) and
    ``solve_nu(nu, method)``. Input channels ("nu", "log_nu"): the network sees the O(1) log
    field, the losses read nu from channel 0. Given fields need "nu" alone; the reference
    solves from nu alone (log_nu is the network's view of the same field)."""

    input_channels = ("nu", "log_nu")
    reference_methods = ("auto", "direct", "amg")
    solves_from_inputs = True
    fields_hint = " (or 'nu' alone: 'log_nu' is derived from it)"

    def nu_nodes(self, params: np.ndarray) -> np.ndarray:
        """(*grid) float64 nu of one parameter vector (m,)."""
        return np.exp(self.log_nu(np.asarray(params, dtype=np.float64).reshape(1, -1))[0])

    def build_input(self, params: np.ndarray, dtype=torch.float32) -> torch.Tensor:
        """(n, 2, *grid): nu and log nu at the nodes."""
        lg = self.log_nu(params)
        return torch.as_tensor(np.stack([np.exp(lg), lg], axis=1), dtype=dtype)

    def inputs_from_fields(self, fields) -> np.ndarray:
        """(N, 2, *grid) inputs from "nu" (and "log_nu", derived from nu when not given)."""
        given = self.check_fields(fields)
        if "nu" in given:
            check_array("field 'nu' (the diffusivity)", given["nu"], positive=True)
            given.setdefault("log_nu", np.log(given["nu"]))
        return self.stack_fields(given)

    def reference_solution(self, params: np.ndarray, method: str = "auto") -> np.ndarray:
        return self.solve_nu(self.nu_nodes(params), method)

    def solve_from_inputs(self, inputs, method: str = "auto") -> np.ndarray:
        return self.solve_nu(self.check_sample(inputs)[self.input_channels.index("nu")], method)


class KLDiffusionProblem(DiffusivityInputs, Problem):
    """Base of Poisson / ReactionDiffusion: nu = exp(KL field) on the unit square, rows = y.

    Inputs, given fields and the reference from nu: ``DiffusivityInputs``.

    Diffusion energy E_d(u) = integral of nu |grad u|^2 / 2 (divided by the domain area, which
    is 1), by ``quadrature``:

    * ``"faces"`` (default): the two-point-flux quadrature. Each x-difference
      (u[i, j+1] - u[i, j]) / hx lives on the horizontal edge between two nodes and gets the
      harmonic face diffusivity and the trapezoidal weight of its row (half on the first/last
      row); likewise for y. Its minimiser is exactly the vertex-centred finite-volume (5-point)
      scheme of the reference solver (second order, no spurious modes). Pure slicing, no conv.
    * ``"nodes"``: nodal gradients from ``FiniteDifference(kind=stencil)`` and the trapezoidal
      nodal weights (boundary 1/2, corners 1/4). Central-type stencils do not see the
      checkerboard mode, so the minimiser decouples odd/even nodes and converges only like
      O(h) (6% / 3.6% / 1.9% relative L2 at 17 / 33 / 65 nodes on a test field vs ~1e-6 for
      "faces"); kept for the ablation.

    ``stencil`` (one of stencils.KINDS) is used by the "nodes" quadrature and by Poisson's
    "residual" loss; the default "faces" energy needs no stencil.

    On a split block (``on_block``) the energies are exact, every quadrature: "faces" counts
    each edge on the block holding its first node (the other from a one-layer halo of u and
    nu), "nodes" takes the block's nodal gradients (``FiniteDifference`` on the block) and
    weights; the nodal weights are the global ones cut to the block.

    The reference solution (``solve_nu``) is ``diffnet.reference.solve_diffusion`` of nu with
    the subclass's ``diffusion_options`` (boundary conditions, reaction, source), by ``method``
    "auto", "direct" (SuperLU) or "amg" (pyamg + CG); nu must be > 0 everywhere.
    """

    param_names: tuple[str, ...] = ()

    def __init__(self, *, grid=(64, 64), n_terms: int = 4, omega_range=(-3.0, 3.0),
                 quadrature: str = "faces", stencil: str = "sobel"):
        super().__init__(grid=grid)
        self.n_terms = check_int("n_terms", n_terms, 4,
                                 what="an integer >= 4 (KL terms of log nu)")
        self.param_names = tuple(f"omega_{i + 1}" for i in range(self.n_terms))
        self.omega_range = check_range("omega_range", omega_range)
        self.quadrature = check_choice("quadrature", quadrature, QUADRATURES)
        self.stencil = check_choice("stencil", stencil, KINDS)
        self.fd_grad = FiniteDifference(self.spacing, self.stencil, derivatives=("r", "c"))
        self._cache: dict = {}

    @property
    def axes(self) -> tuple[Axis, Axis]:
        return (Axis("y", 0.0, 1.0), Axis("x", 0.0, 1.0))

    def param_bounds(self) -> np.ndarray:
        return np.tile(np.array(self.omega_range, dtype=np.float64), (self.n_terms, 1))

    def nu_range(self) -> tuple[float, float]:
        """The extreme values of nu over the family (attained at a corner)."""
        b = log_nu_bound(self.n_terms, self.omega_range)
        return math.exp(-b), math.exp(b)

    def config(self) -> dict:
        return {"grid": list(self.grid), "n_terms": self.n_terms,
                "omega_range": list(self.omega_range), "quadrature": self.quadrature,
                "stencil": self.stencil}

    def log_nu(self, params: np.ndarray) -> np.ndarray:
        """(n, H, W) float64 log nu of parameter vectors (n, m)."""
        params = self.check_params(params)
        c = self.coords()
        return log_diffusivity(params, c["y"], c["x"])

    # -- reference solutions ----------------------------------------------------------------
    @abc.abstractmethod
    def diffusion_options(self) -> dict:
        """Keyword arguments of ``solve_diffusion`` besides nu: dirichlet, kappa, f."""

    def solve_nu(self, nu: np.ndarray, method: str = "auto") -> np.ndarray:
        """(H, W) reference solution for the diffusivity ``nu`` (H, W) at the nodes."""
        from ..reference import solve_diffusion

        lengths = tuple(a.hi - a.lo for a in self.axes)
        return solve_diffusion(nu, lengths=lengths, method=self.check_method(method),
                               **self.diffusion_options())

    # -- quadrature -------------------------------------------------------------------------
    def _weights(self, like: torch.Tensor):
        """Cached (row weights (1,1,H,1), column weights (1,1,1,W), nodal (1,1,H,W))."""
        key = (like.dtype, like.device)
        if key not in self._cache:
            h, w = self.grid
            wr = edge_weights(h).to(like).view(1, 1, h, 1)
            wc = edge_weights(w).to(like).view(1, 1, 1, w)
            self._cache[key] = (wr, wc, wr * wc)
        return self._cache[key]

    def check_block(self, block) -> None:
        if self.quadrature == "nodes":
            check_block_sizes(block)

    def diffusion_energy(self, u: torch.Tensor, nu: torch.Tensor) -> torch.Tensor:
        """(B,) integral of nu |grad u|^2 / 2 over the unit square (see the class docstring);
        on a split block, this block's part of it."""
        return sum((w * f.square()).flatten(1).sum(dim=1)
                   for f, w in self.diffusion_features(u, nu))

    def diffusion_features(self, u: torch.Tensor, nu: torch.Tensor) -> list:
        """The diffusion energy as weighted squares: pairs (F, w), F linear in u and w >= 0
        broadcasting to F's shape, with ``diffusion_energy(u, nu)`` = sum over the pairs of
        sum(w * F^2) per sample. The quadratic form's polar a(u, v) then needs no second
        evaluation: the Ritz Gram matrix is sums of w * F_i * F_j. u may hold K fields per
        sample (B, K, *grid) against one nu (B, 1, *grid): F is then (B, K, ...), field-major
        within a sample, and the weights, which depend on nu only, are made once per sample."""
        wr, wc, wn = (self.part(t) for t in self._weights(u))
        if self.quadrature == "nodes":
            b, k = u.shape[:2]
            d = self.fd_grad(u.reshape(b * k, 1, *u.shape[2:]), self.block)
            return [(d.view(b, k, *d.shape[1:]), (0.5 * nu * wn).unsqueeze(1))]
        if self.block.whole:
            faces = self._face_differences_window(u, nu, (0, 0), self.grid)
        else:
            faces = self._face_differences_part(u, nu)
        return self._edge_pairs(*faces, wr, wc)

    def diffusion_features_window(self, u: torch.Tensor, nu: torch.Tensor, start, stop) -> list:
        """``diffusion_features`` of a window of the (whole, undivided) grid: u (B, K, ...) the
        nodes [start, stop] of each axis (closed, cut at the grid's edge), nu the whole grid's;
        the pairs cover the edges the window owns, those (i, i + 1) with start <= i < stop
        (i < n - 1) across nodes start <= j < stop. Windows that tile the grid this way sum to
        the whole grid's energy. Two-point faces quadrature only."""
        assert self.block.whole and self.quadrature == "faces"
        (y0, x0), (y1, x1) = start, stop
        wr, wc, _ = self._weights(u)
        return self._edge_pairs(*self._face_differences_window(u, nu, start, stop),
                                wr[..., y0:y1, :], wc[..., x0:x1])

    def _edge_pairs(self, dx, nx, dy, ny, wr, wc) -> list:
        """The weighted pairs of the face differences dx, dy (face diffusivities nx, ny; row
        and column weights wr, wc of the same edges)."""
        hy, hx = self.spacing
        h, w = self.grid
        # x-edges: trapezoid across (row weights) x midpoint along (length hx of 1). F is the
        # plain difference and 1 / h^2 sits in the small weight: dividing F (K fields, or 4 K
        # in a partition's Gram matrix) by h would be a whole pass over the largest tensor here.
        return [(dx, nx * (0.5 / ((w - 1) * hx * hx)) * wr),
                (dy, ny * (0.5 / ((h - 1) * hy * hy)) * wc)]

    def _face_differences_window(self, u, nu, start, stop):
        """The edges a window owns (see ``diffusion_features_window``; the whole grid is the
        window from (0, 0) to ``grid``): differences of u (its nodes from ``start``) and
        harmonic-mean nu (the whole grid's) on them along x, then the same along y."""
        (y0, x0), (y1, x1) = start, stop
        h, w = self.grid
        ny, nx = min(y1, h - 1) - y0, min(x1, w - 1) - x0       # owned edges along y, x
        near = nu[..., y0:y0 + ny + 1, x0:x0 + nx + 1]
        rows, cols = u[..., :y1 - y0, :], u[..., :, :x1 - x0]
        dx = rows[..., 1:nx + 1] - rows[..., :nx]
        dy = cols[..., 1:ny + 1, :] - cols[..., :ny, :]
        kx = harmonic_mean(near[..., :y1 - y0, 1:nx + 1], near[..., :y1 - y0, :nx])
        ky = harmonic_mean(near[..., 1:ny + 1, :x1 - x0], near[..., :ny, :x1 - x0])
        return dx, kx, dy, ky

    def _face_differences_part(self, u, nu):
        """The edges this block owns (``owned_edges``): differences (not divided by the
        spacing) and harmonic-mean nu on them along x, then the same along y."""
        p = self.block.halo(torch.cat([u, nu], dim=1), 1)         # one exchange for both
        (u0, n0), (u1, n1) = ((t[:, :-1], t[:, -1:]) for t in owned_edges(p, self.block, 1))
        dx, nx = u1 - u0, harmonic_mean(n1, n0)
        (u0, n0), (u1, n1) = ((t[:, :-1], t[:, -1:]) for t in owned_edges(p, self.block, 0))
        return dx, nx, u1 - u0, harmonic_mean(n1, n0)

    def integrate(self, g: torch.Tensor) -> torch.Tensor:
        """(B,) trapezoidal integral of a nodal field (B, 1, H, W) over the unit square; on a
        split block, of the block's part g (its part of the integral)."""
        return (g * self.part(self._weights(g)[2])).sum(dim=(1, 2, 3))
