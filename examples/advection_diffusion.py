"""A PDE family DeepFusion does not ship: steady advection-diffusion in a random flow.

Written only with the public contract (``diffnet.problems.Problem``, ``Axis``), the stencil
``diffnet.stencils.FiniteDifference`` and the problem's split-exact helpers (``self.mean``,
``self.wall_mean``, ``self.part``), so it trains on a split grid (``parallel.domain``) with no
block code. With this directory on the PYTHONPATH a config names it
``problem.name = "advection_diffusion:AdvectionDiffusion"``. Walk-through: docs/your-own-pde.md.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as spla
import torch

from diffnet.problems import Axis, Problem
from diffnet.stencils import FiniteDifference

MODES = ((1, 1), (2, 1), (1, 2))   # (k, l): stream-function modes sin(k pi x) sin(l pi y)


class AdvectionDiffusion(Problem):
    """Steady advection-diffusion -eps (u_xx + u_yy) + b . grad u = 1 on (y, x) in [0, 1]^2.

    The flow b = (b_y, b_x) = (-psi_x, psi_y) comes from a random stream function psi = sum_i
    a_i sin(k_i pi x) sin(l_i pi y), amplitudes a_i uniform in ``amplitude_range``: it is
    divergence-free and tangent to the walls. ``diffusivity`` is eps. u = 0 on the boundary:
    imposed exactly (``hard_bc``, default: the network's output times 16 x (1 - x) y (1 - y),
    scaled by 1 / (16 eps)), or with ``hard_bc = false`` as "bc" = ``bc_weight`` times the
    mean of u^2 over the four walls. "pde" is the mean over the interior nodes of the squared
    residual by central differences, whose zero is the solution of the 5-point scheme that
    ``reference_solution`` solves with scipy.
    """

    name = "advection_diffusion"
    param_names = tuple(f"a_{i + 1}" for i in range(len(MODES)))
    input_channels = ("b_y", "b_x")

    def __init__(self, *, grid=(16, 16), amplitude_range=(-0.2, 0.2), diffusivity=0.1,
                 hard_bc=True, bc_weight=10.0):
        super().__init__(grid=grid)
        lo, hi = (float(v) for v in amplitude_range)
        if not lo < hi or not float(diffusivity) > 0:
            raise ValueError(f"need amplitude_range (lo, hi) with lo < hi and diffusivity > 0, "
                             f"got {amplitude_range}, {diffusivity}")
        self.amplitude_range, self.eps = (lo, hi), float(diffusivity)
        self.hard_bc, self.bc_weight = bool(hard_bc), float(bc_weight)
        self.fd = FiniteDifference(self.spacing, "central", derivatives=("r", "c", "rr", "cc"))

    def config(self) -> dict:
        return {**super().config(), "amplitude_range": list(self.amplitude_range),
                "diffusivity": self.eps, "hard_bc": self.hard_bc, "bc_weight": self.bc_weight}

    @property
    def axes(self):
        return (Axis("y", 0.0, 1.0), Axis("x", 0.0, 1.0))

    def param_bounds(self) -> np.ndarray:
        return np.array([self.amplitude_range] * len(MODES), dtype=np.float64)

    def build_input(self, params, dtype=torch.float32) -> torch.Tensor:
        """(n, 2, H, W): the flow (b_y, b_x) of each parameter vector, exact derivatives of psi."""
        params = self.check_params(params)
        c = self.coords()
        y, x = np.meshgrid(c["y"], c["x"], indexing="ij")
        b_y = [-k * np.pi * np.cos(k * np.pi * x) * np.sin(l * np.pi * y) for k, l in MODES]
        b_x = [l * np.pi * np.sin(k * np.pi * x) * np.cos(l * np.pi * y) for k, l in MODES]
        flow = np.stack([np.einsum("nk,khw->nhw", params, np.stack(b)) for b in (b_y, b_x)], 1)
        return torch.as_tensor(flow, dtype=dtype)

    def impose(self, u, inputs):
        # 1 / (16 eps): the size of the solution without flow, so the network's output is O(1)
        scale = 1 / (16 * self.eps)
        if not self.hard_bc:
            return u * scale
        y, x = (torch.linspace(0, 1, n, dtype=u.dtype, device=u.device) for n in self.grid)
        bubble = 16 * (y * (1 - y))[:, None] * (x * (1 - x))[None, :]    # 0 on the walls
        return u * (scale * self.part(bubble))      # the global field, cut to this block

    def loss_terms(self, u, inputs):
        d = self.fd(u, self.block)          # (B, 4, H, W): u_y, u_x, u_yy, u_xx
        r = -self.eps * (d[:, 2] + d[:, 3]) + inputs[:, 0] * d[:, 0] + inputs[:, 1] * d[:, 1] - 1
        pde = self.mean(r.square(), interior=1)
        bc = sum(self.wall_mean(u.square(), axis, side) for axis in (0, 1) for side in ("lo", "hi"))
        return {"pde": pde, "bc": self.bc_weight * bc / 4}

    def reference_solution(self, params, method: str = "auto") -> np.ndarray:
        flow = self.build_input(np.atleast_2d(params), torch.float64)[0]
        return self.solve_from_inputs(flow, method)

    def solve_from_inputs(self, inputs, method: str = "auto") -> np.ndarray:
        """The 5-point central scheme of ``loss_terms`` on the interior nodes, solved exactly."""
        self.check_method(method, from_inputs=True)
        b_y, b_x = self.check_sample(inputs)
        (hy, hx), (n_y, n_x) = self.spacing, self.grid
        eye = [sp.identity(n - 2) for n in (n_y, n_x)]
        second = [sp.diags([1.0, -2.0, 1.0], [-1, 0, 1], (n - 2, n - 2)) / h**2 for n, h in
                  zip((n_y, n_x), (hy, hx))]
        first = [sp.diags([-1.0, 1.0], [-1, 1], (n - 2, n - 2)) / (2 * h) for n, h in
                 zip((n_y, n_x), (hy, hx))]
        inner = (slice(1, -1), slice(1, -1))
        a = (-self.eps * (sp.kron(second[0], eye[1]) + sp.kron(eye[0], second[1]))
             + sp.diags(b_y[inner].ravel()) @ sp.kron(first[0], eye[1])
             + sp.diags(b_x[inner].ravel()) @ sp.kron(eye[0], first[1]))
        u = np.zeros(self.grid)
        u[inner] = spla.spsolve(a.tocsc(), np.ones(a.shape[0])).reshape(n_y - 2, n_x - 2)
        return u
