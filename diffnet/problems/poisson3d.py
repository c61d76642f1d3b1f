"""The generalised Poisson family on the unit cube (3-D DiffNet, problem "poisson3d").

Owns the 3-D problem: its grid and options, the energy (and residual) loss on (B, 1, D, H, W)
node fields, and its reference solution by ``diffnet.reference.solve_diffusion_3d``. The KL
parameters and log nu (``fields.KLDiffusivity``, modes in ``fields3d``), the network inputs
(``fields.DiffusivityInputs``) and the hard Dirichlet values (``poisson.DirichletX``) are the
2-D problems' code.
"""
from __future__ import annotations

import numpy as np
import torch

from ..domain import Block
from ..stencils import KINDS, FiniteDifference, check_block_sizes
from ..validation import check_choice, check_node_grid, check_number
from .base import Axis, Problem
from .fields import QUADRATURES, DiffusivityInputs, KLDiffusivity, axis_weights, nodal_weights
from .fields3d import face_energy_3d
from .poisson import BC_MODES, LOSSES, DirichletX


class Poisson3D(DirichletX, DiffusivityInputs, KLDiffusivity, Problem):
    """-div(nu grad u) = 0 on (z, y, x) in [0, 1]^3, u = 1 on the face x = 0, u = 0 on x = 1,
    zero flux nu du/dn = 0 on the four faces y = 0, 1 and z = 0, 1.

    Grid: ``grid = (D, H, W)`` node counts along (z, y, x), boundary nodes included (the 2-D
    convention (H, W) = (y, x) with the depth axis z in front): a field is (B, 1, D, H, W),
    index [..., k, j, i] is the node (z_k, y_j, x_i), and the Dirichlet faces are the first and
    last x-slices [..., 0] and [..., -1]. D, H, W >= 4 each.

    Diffusivity (``fields3d``): nu = exp(sum_{i=1..M} omega_i lambda_i cos(k_i pi x)
    cos(l_i pi y) cos(m_i pi z)), lambda_i = 1 / (1 + k_i^2 + l_i^2 + m_i^2), over the modes
    that vary along at least two axes, (0,1,1), (1,0,1), (1,1,0), (1,1,1), (0,1,2), (0,2,1), ...
    (by frequency, then k, then l; the single-axis cosines of the 2-D rule would make nu
    separable and, with 4 terms, the solution a function of x alone); M = ``n_terms`` (default
    4; 4 to 6 are the sizes of interest), omega_i uniform in ``omega_range`` (default (-3, 3)).
    |log nu| <= 3.75 for 4 terms (nu in [0.024, 42.5]), 4.75 for 6 (nu in [0.0087, 116])
    (``nu_range()``). param_names = ("omega_1", ..., "omega_M").

    Input channels ("nu", "log_nu"), each (D, H, W). Given fields: "nu" alone is enough.

    ``impose`` ALWAYS makes the Dirichlet values exact, by ``bc_mode``: "overwrite" (default)
    writes 1 on x = 0 and 0 on x = 1 over the network's output; "lift" returns u = (1 - x) +
    4 x (1 - x) * raw (the network learns the departure from the constant-nu solution).

    Loss (``loss``):
      * "energy" (default): "pde" = integral of nu |grad u|^2 / 2 over the cube, by
        ``quadrature``: "faces" (default; harmonic face nu, trapezoid across and midpoint
        along, ``fields3d.face_energy_3d``), whose minimiser is exactly the 7-point
        finite-volume reference solution (its gradient at the free nodes is that scheme's
        residual); or "nodes" (nodal gradients by ``FiniteDifference(kind=stencil)``,
        trapezoidal nodal weights; the checkerboard-blind ablation). The zero-flux faces are
        the energy's natural condition: "bc" = 0. Minimum: the effective conductance / 2 (0.5
        for nu = 1, u = 1 - x).
      * "residual" (ablation): "pde" = mean over the interior nodes of (u_xx + u_yy + u_zz +
        grad(log nu) . grad u)^2 = (div(nu grad u) / nu)^2, derivatives of u and log nu by ONE
        ``FiniteDifference(kind=stencil)`` call; "bc" = bc_weight * the mean over the four
        zero-flux faces of the mean of (du/dn)^2 there.

    Domain parallelism: every loss, quadrature and ``bc_mode`` splits exactly on a block of the
    (D, H, W) grid (``on_block``), as the 2-D ``Poisson`` does.
    """

    name = "poisson3d"
    residual_threshold = 0.06    # of answer_residual: docs/answer-check.md says how chosen
    dims = 3                     # grid axes (z, y, x); the 2-D problems have 2

    def __init__(self, *, grid=(32, 32, 32), n_terms: int = 4, omega_range=(-3.0, 3.0),
                 loss: str = "energy", quadrature: str = "faces", stencil: str = "sobel",
                 bc_weight: float = 1.0, bc_mode: str = "overwrite"):
        # Not Problem.__init__: its grid check is the 2-D one.
        self.grid = check_node_grid(grid, 3)
        self.block = Block(self.grid)
        self.init_kl(n_terms, omega_range)
        self.loss = check_choice("loss", loss, LOSSES)
        self.quadrature = check_choice("quadrature", quadrature, QUADRATURES)
        self.stencil = check_choice("stencil", stencil, KINDS)
        self.bc_weight = check_number("bc_weight", bc_weight, lo=0.0)
        self.bc_mode = check_choice("bc_mode", bc_mode, BC_MODES)
        names = ("d", "r", "c", "dd", "rr", "cc") if self.loss == "residual" else ("d", "r", "c")
        self.fd = FiniteDifference(self.spacing, self.stencil, derivatives=names)
        self._cache: dict = {}

    @property
    def axes(self) -> tuple[Axis, Axis, Axis]:
        return (Axis("z", 0.0, 1.0), Axis("y", 0.0, 1.0), Axis("x", 0.0, 1.0))

    def config(self) -> dict:
        return {"grid": list(self.grid), "n_terms": self.n_terms,
                "omega_range": list(self.omega_range), "loss": self.loss,
                "quadrature": self.quadrature, "stencil": self.stencil,
                "bc_weight": self.bc_weight, "bc_mode": self.bc_mode}

    # -- losses -------------------------------------------------------------------------------
    def _weights(self, like: torch.Tensor):
        key = ("w", like.dtype, like.device)
        if key not in self._cache:
            self._cache[key] = (axis_weights(self.grid, like), nodal_weights(self.grid, like))
        return self._cache[key]

    def check_block(self, block) -> None:
        if self.loss == "residual" or self.quadrature == "nodes":
            check_block_sizes(block)

    def diffusion_energy(self, u: torch.Tensor, nu: torch.Tensor) -> torch.Tensor:
        """(B,) integral of nu |grad u|^2 / 2 over the cube, by ``quadrature``; on a split
        block, this block's part of it."""
        axis_w, nodal_w = self._weights(u)
        if self.quadrature == "faces":
            return face_energy_3d(u, nu, self.spacing, axis_w, self.block)
        g = self.fd(u, self.block)
        return 0.5 * (nu * g.square().sum(dim=1, keepdim=True)
                      * self.part(nodal_w)).sum(dim=(1, 2, 3, 4))

    def loss_terms(self, u: torch.Tensor, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.loss == "energy":
            pde = self.diffusion_energy(u, inputs[:, 0:1])
            return {"pde": pde, "bc": torch.zeros_like(pde)}
        b = u.shape[0]
        d = self.fd(torch.cat([u, inputs[:, 1:2]], dim=0), self.block)   # u and log nu, one conv
        du, dl = d[:b], d[b:]
        r = du[:, 3] + du[:, 4] + du[:, 5] + (dl[:, :3] * du[:, :3]).sum(dim=1)
        dz2, dy2 = du[:, 0].square(), du[:, 1].square()      # the z and y walls' (du/dn)^2
        bc = (self.wall_mean(dz2, 0, "lo") + self.wall_mean(dz2, 0, "hi")
              + self.wall_mean(dy2, 1, "lo") + self.wall_mean(dy2, 1, "hi")) / 4
        return {"pde": self.mean(r.square(), interior=1), "bc": self.bc_weight * bc}

    # -- reference solutions ------------------------------------------------------------------
    def diffusion_options(self) -> dict:
        """Keyword arguments of ``solve_diffusion_3d`` besides nu (as the 2-D problems')."""
        return {"dirichlet": "poisson"}

    def solve_nu(self, nu: np.ndarray, method: str = "auto") -> np.ndarray:
        """(D, H, W) reference solution for the diffusivity ``nu`` (D, H, W) at the nodes."""
        from ..reference import solve_diffusion_3d

        lengths = tuple(a.hi - a.lo for a in self.axes)
        return solve_diffusion_3d(nu, lengths=lengths, method=self.check_method(method),
                                  **self.diffusion_options())

    def system_nu(self, nu: np.ndarray):
        """The assembled reference system (``ReferenceSystem``) for the diffusivity ``nu``."""
        from ..reference import diffusion_system_3d

        lengths = tuple(a.hi - a.lo for a in self.axes)
        return diffusion_system_3d(nu, lengths=lengths, **self.diffusion_options())
