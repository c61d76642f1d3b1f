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

The KL functions (``kl_modes``, ``kl_eigenvalues``, ``log_diffusivity``, ``log_nu_bound``) and
the weights (``axis_weights``, ``nodal_weights``, ``trapezoid_weights``) are written once for
any number of grid axes; the formulas above are their 2-D case, ``fields3d`` states the 3-D one.
"""
from __future__ import annotations

import abc
import functools
import itertools
import math
import operator

import numpy as np
import torch

from ..domain import Block
from ..stencils import KINDS, FiniteDifference, check_block_sizes
from ..validation import check_array, check_choice, check_int, check_range
from .answer_check import elliptic_residual
from .base import Axis, Problem


def kl_modes(n_terms: int, dims: int = 2) -> list[tuple[int, ...]]:
    """The first ``n_terms`` frequency tuples of a ``dims``-axis grid, listed along the grid
    axes in reverse: (k, l) in 2-D, (k, l, m) in 3-D (k along x, l along y, m along z).

    A mode has at least max(1, dims - 1) non-zero entries: every pair but (0, 0) in 2-D, the
    triples coupling at least two axes in 3-D (``fields3d`` says why). Ordered by k^2 + l^2 + ...,
    then k, then l, ...
    """
    n = int(math.isqrt(int(n_terms))) + 2
    least = max(1, dims - 1)
    modes = [t for t in itertools.product(range(n + 1), repeat=dims)
             if sum(v > 0 for v in t) >= least]
    modes.sort(key=lambda t: (sum(v * v for v in t), *t[:-1]))
    return modes[:n_terms]


def kl_eigenvalues(n_terms: int, dims: int = 2) -> np.ndarray:
    """lambda_i = 1 / (1 + k_i^2 + l_i^2 + ...) of the first ``n_terms`` modes."""
    return np.array([1.0 / (1.0 + sum(v * v for v in t)) for t in kl_modes(n_terms, dims)])


def log_diffusivity(omega: np.ndarray, *coords, lengths=None) -> np.ndarray:
    """log nu on the node grid whose axes have the 1-D coordinates ``coords`` (grid order:
    (y, x) in 2-D, (z, y, x) in 3-D) and ``lengths`` (default 1 each): omega (n, m) ->
    (n, *grid) float64."""
    omega = np.asarray(omega, dtype=np.float64)
    dims = len(coords)
    lengths = (1.0,) * dims if lengths is None else tuple(lengths)
    coords = [np.asarray(c, dtype=np.float64) for c in coords]
    lam = kl_eigenvalues(omega.shape[1], dims)
    letters = "abc"[:dims]

    def mode(t):     # the separable cosine product of one mode; t lists the axes in reverse
        f = [np.cos(t[dims - 1 - a] * np.pi * c / n)
             for a, (c, n) in enumerate(zip(coords, lengths))]
        return f[0] if dims == 1 else np.einsum(",".join(letters) + "->" + letters, *f)

    basis = np.stack([lam[i] * mode(t) for i, t in enumerate(kl_modes(omega.shape[1], dims))])
    return np.tensordot(omega, basis, axes=(1, 0))


def log_nu_bound(n_terms: int, omega_range, dims: int = 2) -> float:
    """max |log nu| over the family (attained at a corner)."""
    return float(max(abs(omega_range[0]), abs(omega_range[1]))
                 * kl_eigenvalues(n_terms, dims).sum())


def edge_weights(n: int) -> torch.Tensor:
    """(n,) 1-D trapezoidal weights normalised to sum to 1 (the two end nodes get half)."""
    wv = torch.full((n,), 1.0 / (n - 1), dtype=torch.float64)
    wv[0] = wv[-1] = 0.5 / (n - 1)
    return wv


def axis_weights(grid, like: torch.Tensor) -> list[torch.Tensor]:
    """Normalised 1-D trapezoidal weights (each sums to 1) of every grid axis, shaped to
    broadcast along it: (1, 1, H, 1), (1, 1, 1, W) in 2-D, in ``like``'s dtype and device."""
    out = []
    for axis, n in enumerate(grid):
        shape = [1] * (2 + len(grid))
        shape[2 + axis] = n
        out.append(edge_weights(n).to(like).view(shape))
    return out


def nodal_weights(grid, like: torch.Tensor) -> torch.Tensor:
    """(1, 1, *grid) trapezoidal nodal weights summing to 1 (a boundary node has half an
    interior node's weight per boundary it is on), in ``like``'s dtype and device."""
    return functools.reduce(operator.mul, axis_weights(grid, like))


def trapezoid_weights(grid, dtype=torch.float64) -> torch.Tensor:
    """``grid``-shaped trapezoidal nodal weights normalised to sum to 1 (boundary 1/2, corners
    1/4 in 2-D), computed in float64."""
    return nodal_weights(grid, torch.zeros((), dtype=torch.float64)).reshape(tuple(grid)).to(dtype)


def harmonic_mean(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """2ab / (a + b), the face diffusivity of two positive nodal values."""
    return 2.0 * a * b / (a + b)


def block_coords(problem, block: Block | None = None) -> list[np.ndarray]:
    """The 1-D node coordinates of ``block`` of ``problem``'s grid (default: the whole grid),
    one array per axis in grid order: slices of ``problem.coords()``, so a field evaluated
    pointwise on them is the whole grid's field cut to the block, bit for bit. ValueError if
    ``block`` is a block of another grid."""
    block = Block(problem.grid) if block is None else block
    if tuple(block.grid) != tuple(problem.grid):
        raise ValueError(f"block {block!r} is a block of grid {list(block.grid)}, but problem "
                         f"{problem.name!r} is on grid {list(problem.grid)}")
    c = problem.coords()
    return [c[a.name][s:s + n] for a, s, n in zip(problem.axes, block.start, block.shape)]


# ----------------------------------------------------------------------------------------------
# Shared base of the two elliptic families (diffusivity sampling, inputs, energy quadrature).
# ----------------------------------------------------------------------------------------------

QUADRATURES = ("faces", "nodes")


class DiffusivityInputs:
    """Inputs and reference of a problem whose coefficient is a diffusivity nu > 0 at the
    nodes, for any number of axes. The class gives ``log_nu(params)`` (n, *grid),
    ``solve_nu(nu, method)`` and ``system_nu(nu)`` (the assembled ``ReferenceSystem``, which
    ``refine`` solves from an initial guess). Input channels ("nu", "log_nu"): the network sees the O(1) log
    field, the losses read nu from channel 0. Given fields need "nu" alone; the reference
    solves from nu alone (log_nu is the network's view of the same field)."""

    input_channels = ("nu", "log_nu")
    reference_methods = ("auto", "direct", "amg")
    solves_from_inputs = True
    refines = True
    fields_hint = " (or 'nu' alone: 'log_nu' is derived from it)"

    def nu_nodes(self, params: np.ndarray) -> np.ndarray:
        """(*grid) float64 nu of one parameter vector (m,)."""
        return np.exp(self.log_nu(np.asarray(params, dtype=np.float64).reshape(1, -1))[0])

    def build_input(self, params: np.ndarray, dtype=torch.float32) -> torch.Tensor:
        """(n, 2, *grid): nu and log nu at the nodes."""
        return self.build_block_input(params, Block(self.grid), dtype)

    def build_block_input(self, params: np.ndarray, block: Block,
                          dtype=torch.float32) -> torch.Tensor:
        """(n, 2, *block.shape): nu and log nu at ``block``'s nodes alone (``log_nu`` is
        pointwise in the node coordinates, so these are the whole grid's values bit for bit)."""
        lg = self.log_nu(params, block)
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

    def answer_residual(self, u, inputs) -> np.ndarray:
        """(B,) the reference solver's residual b - A u summed over subdomains, over the
        lift's (``answer_check.elliptic_residual``)."""
        return elliptic_residual(self, u, inputs)

    def reference_system(self, inputs):
        """The reference solver's assembled system (``diffnet.reference.ReferenceSystem``) of
        one sample's input fields (C, *grid): refine answers from it, warm or cold, on one AMG
        hierarchy."""
        return self.system_nu(self.check_sample(inputs)[self.input_channels.index("nu")])

    def refine(self, inputs, u0, tol: float = 1e-8):
        """The answer ``u0`` refined by the reference AMG-preconditioned CG (``Problem.refine``);
        u0 None: the cold start."""
        tol = self.check_refine(tol)
        return self.reference_system(inputs).refine(u0, tol)


class KLDiffusivity:
    """The KL log-normal diffusivity family of a problem on a grid of any number of axes:
    ``n_terms`` coefficients omega_1 ... omega_m uniform in ``omega_range``, log nu at the nodes
    by ``log_diffusivity`` over the problem's axes, and the range of nu over the family."""

    def init_kl(self, n_terms: int, omega_range) -> None:
        """Check and set ``n_terms``, ``omega_range`` and the parameter names."""
        self.n_terms = check_int("n_terms", n_terms, 4,
                                 what="an integer >= 4 (KL terms of log nu)")
        self.param_names = tuple(f"omega_{i + 1}" for i in range(self.n_terms))
        self.omega_range = check_range("omega_range", omega_range)

    def param_bounds(self) -> np.ndarray:
        return np.tile(np.array(self.omega_range, dtype=np.float64), (self.n_terms, 1))

    def nu_range(self) -> tuple[float, float]:
        """The extreme values of nu over the family (attained at a corner)."""
        b = log_nu_bound(self.n_terms, self.omega_range, dims=len(self.grid))
        return math.exp(-b), math.exp(b)

    def log_nu(self, params: np.ndarray, block: Block | None = None) -> np.ndarray:
        """(n, *grid) float64 log nu of parameter vectors (n, m); (n, *block.shape) on the
        nodes of ``block`` alone when given."""
        params = self.check_params(params)
        return log_diffusivity(params, *block_coords(self, block))


class KLDiffusionProblem(DiffusivityInputs, KLDiffusivity, Problem):
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
        self.init_kl(n_terms, omega_range)
        self.quadrature = check_choice("quadrature", quadrature, QUADRATURES)
        self.stencil = check_choice("stencil", stencil, KINDS)
        self.fd_grad = FiniteDifference(self.spacing, self.stencil, derivatives=("r", "c"))
        self._cache: dict = {}

    @property
    def axes(self) -> tuple[Axis, Axis]:
        return (Axis("y", 0.0, 1.0), Axis("x", 0.0, 1.0))

    def config(self) -> dict:
        return {"grid": list(self.grid), "n_terms": self.n_terms,
                "omega_range": list(self.omega_range), "quadrature": self.quadrature,
                "stencil": self.stencil}

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

    def system_nu(self, nu: np.ndarray):
        """The assembled reference system (``ReferenceSystem``) for the diffusivity ``nu``."""
        from ..reference import diffusion_system

        lengths = tuple(a.hi - a.lo for a in self.axes)
        return diffusion_system(nu, lengths=lengths, **self.diffusion_options())

    # -- quadrature -------------------------------------------------------------------------
    def _weights(self, like: torch.Tensor):
        """Cached (row weights (1,1,H,1), column weights (1,1,1,W), nodal (1,1,H,W))."""
        key = (like.dtype, like.device)
        if key not in self._cache:
            wr, wc = axis_weights(self.grid, like)
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
        faces = []      # differences of u (not divided by the spacing), harmonic-mean nu
        for axis in (1, 0):                                                # x-, then y-edges
            [((u0, n0), (u1, n1))] = self.edges((u, nu), axes=(axis,))
            faces += [u1 - u0, harmonic_mean(n1, n0)]
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

    def integrate(self, g: torch.Tensor) -> torch.Tensor:
        """(B,) trapezoidal integral of a nodal field (B, 1, H, W) over the unit square; on a
        split block, of the block's part g (its part of the integral)."""
        return (g * self.part(self._weights(g)[2])).sum(dim=(1, 2, 3))
