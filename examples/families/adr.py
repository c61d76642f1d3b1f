"""A benchmark family of your own: advection-diffusion-reaction with non-zero Dirichlet data.

Written with the public API only (``diffnet.problems.Problem``, ``Axis``, the stencil
``diffnet.stencils.FiniteDifference`` and the problem's split-exact helpers) and the shared
pieces of ``gridtools``. With ``examples/families`` on the PYTHONPATH a config names it
``problem.name = "adr:ADR"``; examples/families/README.md has the commands.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch

import gridtools as gt
from diffnet.problems import Axis, bubble, dirichlet, mesh
from diffnet.stencils import FiniteDifference

A_MODES = ((0, 1), (1, 0), (1, 1), (1, 2))   # (k_y, k_x) of log a's modes cos(k_y pi y) cos(k_x pi x)
LIFT_MODES = ((0, 1), (1, 0))                # G = g_1 cos(pi x) + g_2 cos(pi y)
SOURCE, REACTION = 1.0, 1.0


class ADR(gt.ResidualFamily):
    """-div(a grad u) + b . grad u + u = 1 on (y, x) in [0, 1]^2, u = g on the boundary.

    Draw (8 parameters, uniform): log a = sum_i omega_i cos(k_i pi y) cos(l_i pi x) over four
    zero-mean modes, omega_i in ``omega_range`` (default (-0.5, 0.5): a in [e^-2, e^2] at
    worst); a constant flow b = s (sin t, cos t) = (b_y, b_x), direction t in [0, 2 pi), speed
    s in [0, ``max_speed``] (default 4); the Dirichlet data g, the trace of the lift
    G = g_1 cos(pi x) + g_2 cos(pi y), g_1, g_2 in ``lift_range`` (default (-1, 1)).

    Boundary, exact (the contract's ``dirichlet``): u = G + ``output_scale`` * bubble * N, N the
    network's output and bubble = 16 x (1 - x) y (1 - y), zero on the walls; the default scale
    0.25 is the size of u - G.

    Inputs: "log_a", "b_y", "b_x", "phi", "lift" (G), "bubble". Instance norm after the U-Net's
    first (bias-free) convolution removes every channel's spatial mean and any scale common to
    all channels: a constant channel reaches the network as nothing, and the amplitude of a
    channel only relative to the others. So b_y and b_x, constant, are there for the loss and
    the solver alone; the network sees the flow as its potential phi = b . ((y, x) - 1/2), a
    ramp whose slope is b; "bubble", the same in every draw, is the yardstick the other
    channels' amplitudes are read against; the modes of log a have zero mean, so none of the
    coefficient is lost.

    Loss: "pde" = the mean over the interior nodes of r^2, r = ``residual(u, inputs)``: the
    flux form of -div(a grad u) with arithmetic face means of a (``gridtools.flux_divergence``)
    plus central differences for b . grad u, plus u - 1. Its zero is the solution of the same
    scheme ``reference_solution`` solves with scipy (a direct sparse solve).
    """

    name = "adr"
    param_names = (*(f"omega_{i + 1}" for i in range(len(A_MODES))), "flow_angle",
                   "flow_speed", "g_1", "g_2")
    input_channels = ("log_a", "b_y", "b_x", "phi", "lift", "bubble")
    loss_only_channels = ("b_y", "b_x")       # constant fields: the loss's, not the network's

    def __init__(self, *, grid=(64, 64), norm="l2", omega_range=(-0.5, 0.5), max_speed=4.0,
                 lift_range=(-1.0, 1.0), output_scale=0.25):
        super().__init__(grid=grid, norm=norm)
        self.omega_range = gt.interval("omega_range", omega_range)
        self.lift_range = gt.interval("lift_range", lift_range)
        self.max_speed, self.output_scale = float(max_speed), float(output_scale)
        if not (self.max_speed >= 0 and self.output_scale > 0):
            raise ValueError(f"need max_speed >= 0 and output_scale > 0, got {max_speed}, "
                             f"{output_scale}")
        self.fd = FiniteDifference(self.spacing, "central", derivatives=("r", "c", "rr", "cc"))

    def config(self) -> dict:
        return {**super().config(), "omega_range": list(self.omega_range),
                "max_speed": self.max_speed, "lift_range": list(self.lift_range),
                "output_scale": self.output_scale}

    @property
    def axes(self):
        return (Axis("y", 0.0, 1.0), Axis("x", 0.0, 1.0))

    def param_bounds(self) -> np.ndarray:
        return np.array([self.omega_range] * len(A_MODES) + [(0.0, 2 * np.pi),
                        (0.0, self.max_speed)] + [self.lift_range] * len(LIFT_MODES))

    def build_input(self, params, dtype=torch.float32) -> torch.Tensor:
        params = self.check_params(params)
        y, x = points = mesh(self)
        log_a = gt.combine(params[:, :4], gt.cosine_modes(points, A_MODES))
        angle, speed = params[:, 4], params[:, 5]
        b_y, b_x = (speed * np.sin(angle))[:, None, None], (speed * np.cos(angle))[:, None, None]
        phi = b_y * (y - 0.5) + b_x * (x - 0.5)
        lift = gt.combine(params[:, 6:], gt.cosine_modes(points, LIFT_MODES))
        ones = np.ones_like(log_a)
        fields = (log_a, b_y * ones, b_x * ones, phi, lift, bubble(self) * ones)
        return torch.as_tensor(np.stack(fields, 1), dtype=dtype)

    def impose(self, u, inputs):
        return dirichlet(self, u, inputs[:, 4:5], scale=self.output_scale)   # u = g on the walls

    def residual(self, u, inputs):
        """(B, 1, *block) the scheme's residual at every node of the block (meaningful on the
        interior nodes only: the walls hold g exactly)."""
        a = inputs[:, :1].exp()
        d = self.fd(u, self.block)
        advection = inputs[:, 1:2] * d[:, 0:1] + inputs[:, 2:3] * d[:, 1:2]
        return gt.flux_divergence(self.fd, self.block, u, a) + advection + REACTION * u - SOURCE

    def norm_options(self, inputs) -> dict:
        # log a has zero mean, so a is about 1 on average: reaction and speed relative to it
        flow = inputs[:, 1:3].flatten(2)[:, :, 0]           # constant channels: any node
        return {"coefficient": inputs[:, :1].exp(), "reaction": REACTION,
                "advection": flow.square().sum(1).sqrt()}

    def source(self, x: np.ndarray) -> np.ndarray:
        return np.full(self.grid, SOURCE)

    def boundary(self, x: np.ndarray) -> np.ndarray:
        return x[4]

    def operator(self, x: np.ndarray) -> sp.csr_matrix:
        """Flux-form diffusion, central advection, the reaction: ``residual``'s scheme."""
        (hy, hx), (ny, nx) = self.spacing, self.grid
        flow = (sp.diags(x[1].ravel()) @ gt.along(gt.first_difference(ny, hy), 0, self.grid)
                + sp.diags(x[2].ravel()) @ gt.along(gt.first_difference(nx, hx), 1, self.grid))
        return (gt.flux_operator(np.exp(x[0]), self.spacing) + flow
                + REACTION * sp.identity(ny * nx)).tocsr()

