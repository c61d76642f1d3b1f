"""The elliptic problems' shared pieces, for any number of grid axes: the KL-type log-normal
diffusivity, quadrature weights, and the diffusion energy of node fields (2-D and 3-D alike).

Diffusivity (Poisson, reaction-diffusion, the 3-D Poisson), on the node grid of axes
(y, x) in 2-D, (z, y, x) in 3-D::

    nu(omega) = exp( sum_{i=1..m} omega_i * lambda_i * cos(k_i pi x / Lx) * cos(l_i pi y / Ly)
                                                    [* cos(m_i pi z / Lz) in 3-D] ),
    lambda_i = 1 / (1 + k_i^2 + l_i^2 [+ m_i^2]).

The modes run over the integer tuples by frequency k^2 + l^2 (+ m^2), ties broken by k, then l
(``kl_modes``). In 2-D every pair but (0, 0): (0,1), (1,0), (1,1), (0,2), (2,0), (1,2), ...
In 3-D only the triples with AT LEAST TWO non-zero entries: (0,1,1), (1,0,1), (1,1,0), (1,1,1),
(0,1,2), (0,2,1), ... Why not every triple: the first three would be the single-axis cosines,
and with 4 terms log nu = A(x) + B(y, z), i.e. nu = a(x) b(y, z), for which the solution is u(x)
alone (div(a b grad u) = b (a u')' = 0 with zero y- and z-fluxes; exactly so for the
finite-volume scheme too, whose harmonic faces factor the same way): a 1-D family in a 3-D box.
The modes kept couple every pair of axes from the first three terms on, so no axis separates
(``tests/test_poisson3d.py`` checks that the solutions vary along z and y).

The cosines satisfy the zero-flux condition of the Poisson walls (a smooth, even reflection of
the field) and lambda_i decays like an algebraic spectrum, as in a KL expansion of a smooth
covariance. Every mode has amplitude <= 1, so

    |log nu| <= max|omega| * sum_i lambda_i            (``log_nu_bound``),

attained at a domain corner (all cosines are +-1 there). With omega in [-3, 3], in 2-D: m = 4
gives sum lambda = 1/2 + 1/2 + 1/3 + 1/5 = 1.533, |log nu| <= 4.6, nu in [0.010, 99.5]; m = 6:
1.9, 5.7, nu in [0.0033, 299]. In 3-D: m = 4 gives 3/3 + 1/4 = 1.25, 3.75, nu in [0.024, 42.5];
m = 5: 1.417, 4.25, nu in [0.014, 70.1]; m = 6: 1.583, 4.75, nu in [0.0087, 116]. Typical
samples are much milder (the terms rarely align), but the 2-D family does contain contrasts
of 10^4.

Quadrature: ``trapezoid_weights`` gives the nodal weights of the composite trapezoidal rule on
the node grid (a boundary node has half an interior node's weight per boundary it is on),
normalised by the domain's measure so that a weighted sum is the *mean* of the integrand (O(1),
independent of the grid size); ``axis_weights`` are its 1-D factors. The diffusion energy's
quadratures: ``KLDiffusionProblem``.
"""
from __future__ import annotations

import abc
import functools
import itertools
import math
import operator

import numpy as np
import torch

from diffnet.domain import Block
from diffnet.stencils import KINDS, FiniteDifference, check_block_sizes, derivative_names
from diffnet.validation import check_array, check_choice, check_int, check_range
from diffnet.problems.contract.answer_check import elliptic_residual
from diffnet.problems.contract.base import Problem
from diffnet.problems.contract.family import Axis
from diffnet.problems.contract.blocks import block_coords


def kl_modes(n_terms: int, dims: int = 2) -> list[tuple[int, ...]]:
    """The first ``n_terms`` frequency tuples of a ``dims``-axis grid, listed along the grid
    axes in reverse: (k, l) in 2-D, (k, l, m) in 3-D (k along x, l along y, m along z).

    A mode has at least max(1, dims - 1) non-zero entries: every pair but (0, 0) in 2-D, the
    triples coupling at least two axes in 3-D (the module docstring says why). Ordered by
    k^2 + l^2 + ..., then k, then l, ...
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


def axis_weights(grid, like: torch.Tensor) -> list[torch.Tensor]:
    """Normalised 1-D trapezoidal weights (each sums to 1, the two end nodes get half) of every
    grid axis, shaped to broadcast along it: (1, 1, H, 1), (1, 1, 1, W) in 2-D, in ``like``'s
    dtype and device."""
    out = []
    for axis, n in enumerate(grid):
        w = torch.full((n,), 1.0 / (n - 1), dtype=torch.float64)
        w[0] = w[-1] = 0.5 / (n - 1)
        shape = [1] * (2 + len(grid))
        shape[2 + axis] = n
        out.append(w.to(like).view(shape))
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


# ----------------------------------------------------------------------------------------------
# Shared base of the two elliptic families (diffusivity sampling, inputs, energy quadrature).
# ----------------------------------------------------------------------------------------------

QUADRATURES = ("faces", "nodes")


class DiffusivityInputs:
    """Inputs and reference of a problem whose coefficient is a diffusivity nu > 0 at the
    nodes, for any number of axes. The class gives ``log_nu(params)`` (n, *grid),
    ``solve_nu(nu, method)`` and ``system_nu(nu)`` (the assembled ``ReferenceSystem``, which
    ``refine`` solves from an initial guess). Input channels ("nu", "log_nu"): the network sees
    the O(1) log field, the losses read nu from channel 0. Given fields need "nu" alone; the
    reference solves from nu alone (log_nu is the network's view of the same field)."""

    input_channels = ("nu", "log_nu")
    reference_methods = ("auto", "direct", "amg")
    fields_hint = " (or 'nu' alone: 'log_nu' is derived from it)"
    derivations = {"log_nu": "log(nu)"}

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

    def derived_channels(self, inputs: np.ndarray) -> dict[str, np.ndarray]:
        """log_nu = log(nu) (NaN where nu <= 0, which never matches)."""
        nu = inputs[:, self.input_channels.index("nu")]
        with np.errstate(divide="ignore", invalid="ignore"):
            return {"log_nu": np.log(nu)}

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
    """Base of Poisson, Poisson3D and ReactionDiffusion: nu = exp(KL field) on the unit square
    (rows = y) or cube (axes (z, y, x): ``dims = 3``), written once for both.

    Inputs, given fields and the reference from nu: ``DiffusivityInputs``.

    Diffusion energy E_d(u) = integral of nu |grad u|^2 / 2 (divided by the domain's measure,
    which is 1), by ``quadrature``:

    * ``"faces"`` (default): the two-point-flux quadrature. Each difference
      (u[.., i+1] - u[.., i]) / h along an axis lives on the edge between two nodes and gets the
      harmonic face diffusivity, the midpoint weight h along it and the trapezoidal weights of
      the other axes across it (half on a boundary row, in 3-D a quarter on an edge of the box).
      Its minimiser is exactly the vertex-centred finite-volume scheme of the reference solver
      (5-point, 7-point in 3-D; second order, no spurious modes). Pure slicing, no conv.
    * ``"nodes"``: nodal gradients from ``FiniteDifference(kind=stencil)`` and the trapezoidal
      nodal weights. Central-type stencils do not see the checkerboard mode, so the minimiser
      decouples odd/even nodes and converges only like O(h) (6% / 3.6% / 1.9% relative L2 at
      17 / 33 / 65 nodes on a 2-D test field vs ~1e-6 for "faces"); kept for the ablation.

    ``stencil`` (one of stencils.KINDS) is used by the "nodes" quadrature and by Poisson's
    "residual" loss; the default "faces" energy needs no stencil.

    On a split block (``on_block``) the energies are exact, every quadrature: "faces" counts
    each edge on the block holding its first node (the other from a one-layer halo of u and
    nu), "nodes" takes the block's nodal gradients (``FiniteDifference`` on the block) and
    weights; the weights are the global ones cut to the block.

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
        first = derivative_names(self.dims)[:self.dims]          # d/d(axis) of every axis
        self.fd_grad = FiniteDifference(self.spacing, self.stencil, derivatives=first)
        self._cache: dict = {}

    @property
    def axes(self) -> tuple[Axis, ...]:
        return tuple(Axis(name, 0.0, 1.0) for name in "zyx"[-self.dims:])

    def config(self) -> dict:
        return {"grid": list(self.grid), "n_terms": self.n_terms,
                "omega_range": list(self.omega_range), "quadrature": self.quadrature,
                "stencil": self.stencil}

    # -- reference solutions ----------------------------------------------------------------
    @abc.abstractmethod
    def diffusion_options(self) -> dict:
        """Keyword arguments of ``solve_diffusion`` besides nu: dirichlet, kappa, f."""

    def solve_nu(self, nu: np.ndarray, method: str = "auto") -> np.ndarray:
        """(*grid) reference solution for the diffusivity ``nu`` (*grid) at the nodes."""
        from diffnet.reference import solve_diffusion

        lengths = tuple(a.hi - a.lo for a in self.axes)
        return solve_diffusion(nu, lengths=lengths, method=self.check_method(method),
                               **self.diffusion_options())

    def system_nu(self, nu: np.ndarray):
        """The assembled reference system (``ReferenceSystem``) for the diffusivity ``nu``."""
        from diffnet.reference import diffusion_system

        lengths = tuple(a.hi - a.lo for a in self.axes)
        return diffusion_system(nu, lengths=lengths, **self.diffusion_options())

    # -- quadrature -------------------------------------------------------------------------
    def _weights(self, like: torch.Tensor):
        """Cached (``axis_weights``..., the nodal weights (1, 1, *grid): their product)."""
        key = (like.dtype, like.device)
        if key not in self._cache:
            axis_w = axis_weights(self.grid, like)
            self._cache[key] = (*axis_w, functools.reduce(operator.mul, axis_w))
        return self._cache[key]

    def check_block(self, block) -> None:
        if self.quadrature == "nodes":
            check_block_sizes(block)

    def diffusion_energy(self, u: torch.Tensor, nu: torch.Tensor) -> torch.Tensor:
        """(B,) integral of nu |grad u|^2 / 2 over the domain (see the class docstring); on a
        split block, this block's part of it."""
        return sum((w * f.square()).flatten(1).sum(dim=1)
                   for f, w in self.diffusion_features(u, nu))

    def diffusion_features(self, u: torch.Tensor, nu: torch.Tensor) -> list:
        """The diffusion energy as weighted squares: pairs (F, w), F linear in u and w >= 0
        broadcasting to F's shape, with ``diffusion_energy(u, nu)`` = sum over the pairs of
        sum(w * F^2) per sample. The quadratic form's polar a(u, v) then needs no second
        evaluation: the Ritz Gram matrix is sums of w * F_i * F_j. u may hold K fields per
        sample (B, K, *grid) against one nu (B, 1, *grid): F is then (B, K, ...), field-major
        within a sample, and the weights, which depend on nu only, are made once per sample.
        "faces": one pair per axis, the last axis (x) first."""
        *axis_w, wn = (self.part(t) for t in self._weights(u))
        if self.quadrature == "nodes":
            b, k = u.shape[:2]
            d = self.fd_grad(u.reshape(b * k, 1, *u.shape[2:]), self.block)
            return [(d.view(b, k, *d.shape[1:]), (0.5 * nu * wn).unsqueeze(1))]
        faces = []      # differences of u (not divided by the spacing), harmonic-mean nu
        for axis in reversed(range(self.dims)):
            [((u0, n0), (u1, n1))] = self.edges((u, nu), axes=(axis,))
            faces.append((u1 - u0, harmonic_mean(n1, n0)))
        return self._edge_pairs(faces, axis_w)

    def diffusion_features_window(self, u: torch.Tensor, nu: torch.Tensor, start, stop) -> list:
        """``diffusion_features`` of a window of the (whole, undivided) grid: u (B, K, ...) the
        nodes [start, stop] of each axis (closed, cut at the grid's edge), nu the whole grid's;
        the pairs cover the edges the window owns, those (i, i + 1) with start <= i < stop
        (i < n - 1) across nodes start <= j < stop. Windows that tile the grid this way sum to
        the whole grid's energy. Two-point faces quadrature only."""
        assert self.block.whole and self.quadrature == "faces"
        *axis_w, _ = self._weights(u)
        across = [w[_window(self.dims, {a: slice(s, t)})]
                  for a, (w, s, t) in enumerate(zip(axis_w, start, stop))]
        return self._edge_pairs(self._face_differences_window(u, nu, start, stop), across)

    def _edge_pairs(self, faces, axis_w) -> list:
        """The weighted pairs of the face differences and diffusivities ``faces`` (one (d, k)
        per axis, the last axis first) with the weights ``axis_w`` of the axes' nodes."""
        pairs = []
        for (d, k), axis in zip(faces, reversed(range(self.dims))):
            h, n = self.spacing[axis], self.grid[axis]
            across = functools.reduce(operator.mul, [w for a, w in enumerate(axis_w) if a != axis])
            # trapezoid across (the other axes' weights) x midpoint along (length h of 1). F is
            # the plain difference and 1 / h^2 sits in the small weight: dividing F (K fields,
            # or 4 K in a partition's Gram matrix) by h would be a pass over the largest tensor.
            pairs.append((d, k * (0.5 / ((n - 1) * h * h)) * across))
        return pairs

    def _face_differences_window(self, u, nu, start, stop) -> list:
        """The edges a window owns (see ``diffusion_features_window``), (d, k) per axis, the last
        axis first: differences of u (its nodes from ``start``) and harmonic-mean nu (the whole
        grid's) on them."""
        dims, axes = self.dims, range(self.dims - 1, -1, -1)
        owned = [min(t, n - 1) - s for s, t, n in zip(start, stop, self.grid)]   # edges per axis
        near = nu[_window(dims, {a: slice(s, s + owned[a] + 1) for a, s in enumerate(start)})]

        def at(a, along):       # ``along`` on axis a, the nodes start <= j < stop on the others
            return _window(dims, {**{b: slice(None, t - s) for b, (s, t)
                                     in enumerate(zip(start, stop))}, a: along})

        hi, lo = [slice(1, m + 1) for m in owned], [slice(None, m) for m in owned]
        # views first, then differences, then face means: the order of the plain 2-D
        # expressions, so that autograd adds up the gradients of u in the same order
        lines = [u[at(a, slice(None))] for a in axes]
        d = [v[_window(dims, {a: hi[a]})] - v[_window(dims, {a: lo[a]})]
             for v, a in zip(lines, axes)]
        k = [harmonic_mean(near[at(a, hi[a])], near[at(a, lo[a])]) for a in axes]
        return list(zip(d, k))

    def integrate(self, g: torch.Tensor) -> torch.Tensor:
        """(B,) trapezoidal integral of a nodal field (B, 1, *grid) over the domain; on a split
        block, of the block's part g (its part of the integral)."""
        return (g * self.part(self._weights(g)[-1])).sum(dim=tuple(range(1, g.dim())))


def _window(dims: int, slices: dict) -> tuple:
    """The index of a (B, C, *grid) tensor taking ``slices[axis]`` along the grid axes named,
    everything along the others."""
    return (Ellipsis, *(slices.get(a, slice(None)) for a in range(dims)))
