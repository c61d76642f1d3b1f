"""Variable-diffusivity Poisson family (log-normal KL diffusivity), its Dirichlet values on the
x-faces (``DirichletX``) and its losses, written once for any number of grid axes: ``Poisson``
is the 2-D problem, ``poisson3d.Poisson3D`` the same class on a box."""
from __future__ import annotations

import functools
import operator

import torch

from diffnet.generators import impose_dirichlet
from diffnet.problems.contract.operator_norm import operator_norm
from diffnet.problems.contract.residual_norm import residual_norm
from diffnet.stencils import FiniteDifference, check_block_sizes, derivative_names
from diffnet.validation import check_choice, check_number
from diffnet.problems.families.diffusion import KLDiffusionProblem
from diffnet.problems.families.faces_residual import FacesOperator

LOSSES = ("energy", "residual")
BC_MODES = ("overwrite", "lift")
RESIDUAL_NORMS = ("l2", "multilevel", "operator")


class DirichletX:
    """u = 1 on the first x-slice (index 0 of the last grid axis, x = 0) and u = 0 on the last
    (x = 1), exact by ``impose`` on a grid of any number of axes, by ``bc_mode``: "overwrite"
    writes them over the network's output; "lift" returns u = (1 - x) + 4 x (1 - x) * raw.
    The rows along x are cached per dtype and device in ``self._cache``."""

    def _x_profiles(self, like: torch.Tensor):
        """Cached (1, ..., 1, W) rows along x: Dirichlet mask, values, 1 - x, 4 x (1 - x)."""
        key = ("x", like.dtype, like.device)
        if key not in self._cache:
            x = torch.linspace(0.0, 1.0, self.grid[-1], dtype=like.dtype, device=like.device)
            mask = torch.zeros_like(x)
            mask[[0, -1]] = 1
            values = torch.zeros_like(x)
            values[0] = 1
            shape = (1,) * (1 + len(self.grid)) + (-1,)
            self._cache[key] = tuple(t.view(shape)
                                     for t in (mask, values, 1 - x, 4 * x * (1 - x)))
        return self._cache[key]

    def impose(self, u: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        mask, values, base, bubble = (self.part(t) for t in self._x_profiles(u))
        if self.bc_mode == "lift":
            return torch.addcmul(base, bubble, u)
        return impose_dirichlet(u, mask, values)


class Poisson(DirichletX, KLDiffusionProblem):
    """div(nu grad u) = 0 on (y, x) in [0, 1]^2, u = 1 at x = 0, u = 0 at x = 1, nu du/dy = 0 at
    y = 0 and y = 1.

    Diffusivity: nu = exp(sum_{i=1..m} omega_i lambda_i cos(k_i pi x) cos(l_i pi y)) with
    lambda_i = 1 / (1 + k_i^2 + l_i^2), modes ordered by frequency (see ``fields``), m =
    ``n_terms`` (default 4), omega_i uniform in ``omega_range`` (default (-3, 3)); for the
    defaults |log nu| <= 4.6, i.e. nu in [0.010, 99.5] (``nu_range()``).
    param_names = ("omega_1", ..., "omega_m"). Fields are (y, x): rows = y, columns = x.

    Input channels ("nu", "log_nu"): nu at the nodes and log nu.

    ``impose`` ALWAYS makes the Dirichlet values exact (column 0 = 1, last column = 0), by
    ``bc_mode``: "overwrite" (default) writes them over the network's output; "lift" returns
    u = (1 - x) + 4 x (1 - x) * raw, so the network only learns the (smooth) departure from the
    constant-nu solution and no jump appears next to the boundary columns.

    Loss (``loss``):
      * "energy" (default): "pde" = integral of nu |grad u|^2 / 2 over the square (quadrature
        per ``quadrature``, default the two-point-flux "faces" rule whose minimiser is the
        5-point finite-volume solution; see ``KLDiffusionProblem``). The zero-flux walls are the
        energy's natural condition, so "bc" = 0. The minimum is the effective conductance / 2
        (0.5 for nu = 1, u = 1 - x).
      * "residual": "pde" = mean over the interior nodes of (u_xx + u_yy + grad(log nu) . grad u)^2,
        i.e. div(nu grad u) / nu (the same equation, divided by nu > 0 so the term's scale does not
        swing with the 10^4 contrast of nu); derivatives of u and log nu by ONE
        ``FiniteDifference(kind=stencil)`` call. "bc" = bc_weight * mean over the nodes of the two
        walls y = 0, 1 of (du/dy)^2 (the Neumann condition as a soft term).
        ``residual_norm`` measures that residual: "l2" (default) by its mean square as above;
        "multilevel" by ``residual_norm(r, self, coefficient=1 / nu)``, its split-exact
        multilevel norm (H^-1-like: conditioned like the energy instead of its square;
        :mod:`.contract.residual_norm`), of div(nu grad u) / sqrt(nu).
        "operator": a conservative residual instead, r = dE/du / h^2 at every node (E the
        "faces" energy: the five-point finite-volume -div(nu grad u), half cells on the walls,
        zero exactly at the reference solution; :mod:`.faces_residual`), the Dirichlet columns
        x = 0, 1 not unknowns, and "pde" = ``operator_norm(r, self, apply, interior=(0, 1))``
        / 2 with ``apply`` the same linear map (:mod:`.contract.operator_norm`: a V-cycle of
        that operator, so "pde" is about the energy error whatever the contrast of nu). Why
        not the Sobel residual above: operator_norm needs a symmetric operator, and the
        non-conservative form's linear part is not. The walls' zero flux is in r's wall rows
        (the energy's natural condition), so "bc" = 0 and ``bc_weight`` and ``stencil`` do
        not enter; ``quadrature`` must be "faces" (the "nodes" energy's gradient is neither
        radius 1 nor the reference's scheme). Either ``bc_mode``.

    Domain parallelism: every loss, quadrature and ``bc_mode`` splits exactly (``on_block``):
    the interior mean of "residual" follows global node indices and each wall counts on the
    blocks holding it; "operator" gathers r and its stencil whole on every block.

    The code holds for any number of axes (``dims``): ``Poisson3D`` is this class on the cube.
    """

    name = "poisson"
    residual_threshold = 0.06    # of answer_residual: docs/answer-check.md says how chosen

    def __init__(self, *, grid=(64, 64), n_terms: int = 4, omega_range=(-3.0, 3.0),
                 loss: str = "energy", quadrature: str = "faces", stencil: str = "sobel",
                 bc_weight: float = 1.0, bc_mode: str = "overwrite", residual_norm: str = "l2"):
        super().__init__(grid=grid, n_terms=n_terms, omega_range=omega_range,
                         quadrature=quadrature, stencil=stencil)
        self.loss = check_choice("loss", loss, LOSSES)
        self.bc_weight = check_number("bc_weight", bc_weight, lo=0.0)
        self.bc_mode = check_choice("bc_mode", bc_mode, BC_MODES)
        self.residual_norm = check_choice("residual_norm", residual_norm, RESIDUAL_NORMS)
        if self.conservative and self.quadrature != "faces":
            raise ValueError('residual_norm = "operator" measures the gradient of the "faces" '
                             'energy (the finite-volume residual), not of quadrature = '
                             f'{self.quadrature!r}: set quadrature = "faces" (the default)')
        if self.loss == "residual" and not self.conservative:   # first, then second derivatives
            self.fd = FiniteDifference(self.spacing, self.stencil,
                                       derivatives=derivative_names(self.dims)[:2 * self.dims])

    @property
    def conservative(self) -> bool:
        """Is the loss the conservative residual in operator_norm (class docstring)?"""
        return self.loss == "residual" and self.residual_norm == "operator"

    def config(self) -> dict:
        return {**super().config(), "loss": self.loss, "bc_weight": self.bc_weight,
                "bc_mode": self.bc_mode, "residual_norm": self.residual_norm}

    def check_block(self, block) -> None:
        super().check_block(block)
        if self.loss == "residual" and not self.conservative:
            check_block_sizes(block)

    def loss_terms(self, u: torch.Tensor, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.loss == "energy":
            pde = self.diffusion_energy(u, inputs[:, 0:1])
            return {"pde": pde, "bc": torch.zeros_like(pde)}
        if self.conservative:
            return self.conservative_terms(u, inputs)
        b, n = u.shape[0], self.dims
        d = self.fd(torch.cat([u, inputs[:, 1:2]], dim=0), self.block)   # u and log nu, one conv
        du, dl = d[:b], d[b:]
        # Laplacian + grad(log nu) . grad u, added in the order of the plain 2-D expression
        r = du[:, n]
        for a in range(1, n):
            r = r + du[:, n + a]
        for a in range(n):
            r = r + dl[:, a] * du[:, a]                                         # (B, *grid)
        walls = []      # (du/dn)^2 on the zero-flux walls: both ends of every axis but x
        for a in range(n - 1):
            g2 = du[:, a].square()
            walls += [self.wall_mean(g2, a, "lo"), self.wall_mean(g2, a, "hi")]
        bc = functools.reduce(operator.add, walls) / len(walls)
        # r is div(nu grad u) / nu; the norm of an operator with coefficient nu weighs its
        # residual by 1 / sqrt(nu), so r by sqrt(nu): coefficient 1 / nu
        pde = (self.mean(r.square(), interior=1) if self.residual_norm == "l2"
               else residual_norm(r, self, coefficient=1 / inputs[:, 0:1]))
        return {"pde": pde, "bc": self.bc_weight * bc}

    def conservative_terms(self, u: torch.Tensor, inputs: torch.Tensor) -> dict:
        """The terms of the conservative residual: "pde" = operator_norm / 2 of the energy's
        gradient / h^2 (about the energy error), "bc" = 0."""
        apply = FacesOperator(self, inputs[:, 0:1].detach())
        pde = 0.5 * operator_norm(apply(u), self, apply,
                                  interior=(0,) * (self.dims - 1) + (1,))
        return {"pde": pde, "bc": torch.zeros_like(pde)}

    def diffusion_options(self) -> dict:
        return {"dirichlet": "poisson"}
