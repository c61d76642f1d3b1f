"""A benchmark family of your own in 3-D: variable-coefficient diffusion-reaction on the unit
cube with non-zero Dirichlet data.

Written with the public API only (``diffnet.problems.Problem``, ``Axis``, the stencil
``diffnet.stencils.FiniteDifference`` and the problem's split-exact helpers) and the shared
pieces of ``gridtools``. With ``examples/families`` on the PYTHONPATH a config names it
``problem.name = "diffusion3d:Diffusion3D"``; examples/families/README.md has the commands.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch

import gridtools as gt
from diffnet.problems import Axis, bubble, mesh
from diffnet.stencils import FiniteDifference

# (k_z, k_y, k_x) of log a's modes cos(k_z pi z) cos(k_y pi y) cos(k_x pi x)
A_MODES = ((0, 0, 1), (0, 1, 0), (1, 0, 0), (1, 1, 1))
LIFT_MODES = ((0, 0, 1), (0, 1, 0), (1, 0, 0))   # G = g_1 cos(pi x) + g_2 cos(pi y) + g_3 cos(pi z)
SOURCE, REACTION = 1.0, 1.0


class Diffusion3D(gt.ResidualFamily):
    """-div(a grad u) + u = 1 on (z, y, x) in [0, 1]^3, u = g on the boundary.

    Draw (7 parameters, uniform): log a = sum_i omega_i times four zero-mean cosine modes,
    omega_i in ``omega_range`` (default (-0.5, 0.5)); the Dirichlet data g, the trace of the
    lift G = g_1 cos(pi x) + g_2 cos(pi y) + g_3 cos(pi z), g_i in ``lift_range`` (default
    (-1, 1)).

    Boundary, exact: u = G + ``output_scale`` * bubble * N, N the network's output and bubble =
    64 x (1 - x) y (1 - y) z (1 - z), zero on the walls (default scale 0.25, the size of u - G).

    Inputs: "log_a", "lift" (G), "bubble". Instance norm after the U-Net's first (bias-free)
    convolution removes every channel's spatial mean and any scale common to all channels, so
    each channel carries its draw in its variation (the modes have zero mean) and "bubble",
    the same in every draw, is the yardstick the other channels' amplitudes are read against.

    Loss: "pde" = the mean over the interior nodes of r^2, r = ``residual(u, inputs)``: the
    flux form of -div(a grad u) with arithmetic face means of a (7-point,
    ``gridtools.flux_divergence``) plus u - 1. Its zero is the solution of the same scheme
    ``reference_solution`` solves with scipy: symmetric, by conjugate gradients with an
    algebraic multigrid preconditioner (pyamg, Ruge-Stuben) to a relative residual of 1e-13.
    """

    name = "diffusion3d"
    dims = 3
    param_names = (*(f"omega_{i + 1}" for i in range(len(A_MODES))),
                   *(f"g_{i + 1}" for i in range(len(LIFT_MODES))))
    input_channels = ("log_a", "lift", "bubble")
    symmetric = True

    def __init__(self, *, grid=(32, 32, 32), norm="l2", omega_range=(-0.5, 0.5),
                 lift_range=(-1.0, 1.0), output_scale=0.25):
        super().__init__(grid=grid, norm=norm)
        self.omega_range = gt.interval("omega_range", omega_range)
        self.lift_range = gt.interval("lift_range", lift_range)
        self.output_scale = float(output_scale)
        if not self.output_scale > 0:
            raise ValueError(f"need output_scale > 0, got {output_scale}")
        self.fd = FiniteDifference(self.spacing, "central", derivatives=("dd", "rr", "cc"))

    def config(self) -> dict:
        return {**super().config(), "omega_range": list(self.omega_range),
                "lift_range": list(self.lift_range), "output_scale": self.output_scale}

    @property
    def axes(self):
        return (Axis("z", 0.0, 1.0), Axis("y", 0.0, 1.0), Axis("x", 0.0, 1.0))

    def param_bounds(self) -> np.ndarray:
        return np.array([self.omega_range] * len(A_MODES) + [self.lift_range] * len(LIFT_MODES))

    def build_input(self, params, dtype=torch.float32) -> torch.Tensor:
        params = self.check_params(params)
        points = mesh(self)
        log_a = gt.combine(params[:, :4], gt.cosine_modes(points, A_MODES))
        lift = gt.combine(params[:, 4:], gt.cosine_modes(points, LIFT_MODES))
        wall_zero = bubble(self) * np.ones_like(lift)
        return torch.as_tensor(np.stack((log_a, lift, wall_zero), 1), dtype=dtype)

    def impose(self, u, inputs):
        return inputs[:, 1:2] + self.output_scale * inputs[:, 2:3] * u

    def residual(self, u, inputs):
        """(B, 1, *block) the scheme's residual at every node of the block (meaningful on the
        interior nodes only: the walls hold g exactly)."""
        a = inputs[:, :1].exp()
        return gt.flux_divergence(self.fd, self.block, u, a) + REACTION * u - SOURCE

    def norm_options(self, inputs) -> dict:
        # log a has zero mean, so a is about 1 on average: the reaction relative to it
        return {"coefficient": inputs[:, :1].exp(), "reaction": REACTION}

    def source(self, x: np.ndarray) -> np.ndarray:
        return np.full(self.grid, SOURCE)

    def boundary(self, x: np.ndarray) -> np.ndarray:
        return x[1]

    def operator(self, x: np.ndarray) -> sp.csr_matrix:
        """Flux-form diffusion (7-point) plus the reaction: ``residual``'s scheme."""
        n = int(np.prod(self.grid))
        return (gt.flux_operator(np.exp(x[0]), self.spacing) + REACTION * sp.identity(n)).tocsr()
