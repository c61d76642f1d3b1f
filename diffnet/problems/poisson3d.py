"""The generalised Poisson family on the unit cube (3-D DiffNet, problem "poisson3d").

Owns the 3-D problem: its parameters (the KL coefficients of log nu, field in ``fields3d``),
network inputs, hard Dirichlet values, the energy (and residual) loss on (B, 1, D, H, W) node
fields, and its reference solution by ``diffnet.reference.solve_diffusion_3d``.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..domain import Block
from ..generators import impose_dirichlet
from ..stencils import KINDS, FiniteDifference3D, check_block_sizes
from ..validation import (check_choice, check_int, check_node_grid, check_number,
                          check_range)
from .base import Axis, Problem
from .blocks import mean_part
from .fields import DiffusivityInputs
from .fields3d import (axis_weights_3d, face_energy_3d, face_energy_3d_part, log_diffusivity_3d,
                       log_nu_bound_3d, nodal_weights_3d)

LOSSES = ("energy", "residual")
BC_MODES = ("overwrite", "lift")
QUADRATURES = ("faces", "nodes")


class Poisson3D(DiffusivityInputs, Problem):
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
        residual); or "nodes" (nodal gradients by ``FiniteDifference3D(kind=stencil)``,
        trapezoidal nodal weights; the checkerboard-blind ablation). The zero-flux faces are
        the energy's natural condition: "bc" = 0. Minimum: the effective conductance / 2 (0.5
        for nu = 1, u = 1 - x).
      * "residual" (ablation): "pde" = mean over the interior nodes of (u_xx + u_yy + u_zz +
        grad(log nu) . grad u)^2 = (div(nu grad u) / nu)^2, derivatives of u and log nu by ONE
        ``FiniteDifference3D(kind=stencil)`` call; "bc" = bc_weight * the mean over the four
        zero-flux faces of the mean of (du/dn)^2 there.

    Domain parallelism: every loss, quadrature and ``bc_mode`` splits exactly on a block of the
    (D, H, W) grid (``on_block``), as the 2-D ``Poisson`` does.
    """

    name = "poisson3d"
    dims = 3                     # grid axes (z, y, x); the 2-D problems have 2

    def __init__(self, *, grid=(32, 32, 32), n_terms: int = 4, omega_range=(-3.0, 3.0),
                 loss: str = "energy", quadrature: str = "faces", stencil: str = "sobel",
                 bc_weight: float = 1.0, bc_mode: str = "overwrite"):
        # Not Problem.__init__: its grid check is the 2-D one.
        self.grid = check_node_grid(grid, 3)
        self.block = Block(self.grid)
        self.n_terms = check_int("n_terms", n_terms, 4,
                                 what="an integer >= 4 (KL terms of log nu)")
        self.param_names = tuple(f"omega_{i + 1}" for i in range(self.n_terms))
        self.omega_range = check_range("omega_range", omega_range)
        self.loss = check_choice("loss", loss, LOSSES)
        self.quadrature = check_choice("quadrature", quadrature, QUADRATURES)
        self.stencil = check_choice("stencil", stencil, KINDS)
        self.bc_weight = check_number("bc_weight", bc_weight, lo=0.0)
        self.bc_mode = check_choice("bc_mode", bc_mode, BC_MODES)
        names = ("d", "r", "c", "dd", "rr", "cc") if self.loss == "residual" else ("d", "r", "c")
        self.fd = FiniteDifference3D(self.spacing, self.stencil, derivatives=names)
        self._cache: dict = {}

    @property
    def axes(self) -> tuple[Axis, Axis, Axis]:
        return (Axis("z", 0.0, 1.0), Axis("y", 0.0, 1.0), Axis("x", 0.0, 1.0))

    def config(self) -> dict:
        return {"grid": list(self.grid), "n_terms": self.n_terms,
                "omega_range": list(self.omega_range), "loss": self.loss,
                "quadrature": self.quadrature, "stencil": self.stencil,
                "bc_weight": self.bc_weight, "bc_mode": self.bc_mode}

    # -- parameters and inputs ----------------------------------------------------------------
    def param_bounds(self) -> np.ndarray:
        return np.tile(np.array(self.omega_range, dtype=np.float64), (self.n_terms, 1))

    def nu_range(self) -> tuple[float, float]:
        """The extreme values of nu over the family (attained at a corner)."""
        b = log_nu_bound_3d(self.n_terms, self.omega_range)
        return math.exp(-b), math.exp(b)

    def log_nu(self, params: np.ndarray) -> np.ndarray:
        """(n, D, H, W) float64 log nu of parameter vectors (n, M)."""
        params = self.check_params(params)
        c = self.coords()
        return log_diffusivity_3d(params, c["z"], c["y"], c["x"])

    # -- boundary values and losses -----------------------------------------------------------
    def _x_profiles(self, like: torch.Tensor):
        """Cached (1, 1, 1, 1, W) rows along x: Dirichlet mask, values, 1 - x, 4 x (1 - x)."""
        key = ("x", like.dtype, like.device)
        if key not in self._cache:
            x = torch.linspace(0.0, 1.0, self.grid[2], dtype=like.dtype, device=like.device)
            mask = torch.zeros_like(x)
            mask[[0, -1]] = 1
            values = torch.zeros_like(x)
            values[0] = 1
            self._cache[key] = tuple(t.view(1, 1, 1, 1, -1)
                                     for t in (mask, values, 1 - x, 4 * x * (1 - x)))
        return self._cache[key]

    def impose(self, u: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        mask, values, base, bubble = (self.part(t) for t in self._x_profiles(u))
        if self.bc_mode == "lift":
            return torch.addcmul(base, bubble, u)
        return impose_dirichlet(u, mask, values)

    def _weights(self, like: torch.Tensor):
        key = ("w", like.dtype, like.device)
        if key not in self._cache:
            self._cache[key] = (axis_weights_3d(self.grid, like),
                                nodal_weights_3d(self.grid, like))
        return self._cache[key]

    def check_block(self, block) -> None:
        if self.loss == "residual" or self.quadrature == "nodes":
            check_block_sizes(block)

    def _interior(self, like: torch.Tensor) -> torch.Tensor:
        """(D, H, W) indicator of the interior nodes, cached per dtype/device."""
        key = ("interior", like.dtype, like.device)
        if key not in self._cache:
            m = torch.zeros(self.grid, dtype=like.dtype, device=like.device)
            m[1:-1, 1:-1, 1:-1] = 1
            self._cache[key] = m
        return self._cache[key]

    def diffusion_energy(self, u: torch.Tensor, nu: torch.Tensor) -> torch.Tensor:
        """(B,) integral of nu |grad u|^2 / 2 over the cube, by ``quadrature``; on a split
        block, this block's part of it."""
        axis_w, nodal_w = self._weights(u)
        if self.quadrature == "faces" and not self.block.whole:
            return face_energy_3d_part(u, nu, self.spacing, axis_w, self.block)
        if self.quadrature == "faces":
            return face_energy_3d(u, nu, self.spacing, axis_w)
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
        if not self.block.whole:
            return self._residual_terms_part(r, du)
        pde = r[:, 1:-1, 1:-1, 1:-1].square().mean(dim=(1, 2, 3))
        faces = (du[:, 0, 0], du[:, 0, -1], du[:, 1, :, 0], du[:, 1, :, -1])  # z, y walls
        bc = sum(f.square().mean(dim=(1, 2)) for f in faces) / 4
        return {"pde": pde, "bc": self.bc_weight * bc}

    def _residual_terms_part(self, r: torch.Tensor, du: torch.Tensor) -> dict:
        """This block's parts of the "residual" terms: r (B, d, h, w), du the derivatives."""
        blk = self.block
        n_d, n_h, n_w = self.grid
        inner = (n_d - 2) * (n_h - 2) * (n_w - 2)
        pde = mean_part(r.square() * self.part(self._interior(r)), (1, 2, 3), inner, blk)
        bc = torch.zeros_like(pde)
        # (held here?, normal derivative on the wall (views), nodes of the whole wall)
        faces = ((blk.at_lo(0), du[:, 0, 0], n_h * n_w), (blk.at_hi(0), du[:, 0, -1], n_h * n_w),
                 (blk.at_lo(1), du[:, 1, :, 0], n_d * n_w),
                 (blk.at_hi(1), du[:, 1, :, -1], n_d * n_w))
        for held, face, count in faces:
            if held:
                bc = bc + face.square().sum(dim=(1, 2)) / count
        return {"pde": pde, "bc": self.bc_weight * (bc / 4)}

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
