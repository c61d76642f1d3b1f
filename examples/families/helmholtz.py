"""A benchmark family of your own: a positive Helmholtz (reaction-diffusion) equation with a
random coefficient, a random reaction field and a random source.

Written with the public API only (``diffnet.problems.Problem``, ``Axis``, the stencil
``diffnet.stencils.FiniteDifference`` and the problem's split-exact helpers) and the shared
pieces of ``gridtools``. With ``examples/families`` on the PYTHONPATH a config names it
``problem.name = "helmholtz:Helmholtz"``; examples/families/README.md has the commands.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch

import gridtools as gt
from diffnet.problems import Axis, bubble, mesh
from diffnet.stencils import FiniteDifference

A_MODES = ((0, 1), (1, 0), (1, 1), (1, 2))   # (k_y, k_x) of log a's modes cos(k_y pi y) cos(k_x pi x)
F_MODES = ((0, 1), (1, 0), (1, 1), (2, 2))   # the source's modes, the same form


class Helmholtz(gt.ResidualFamily):
    """-div(a grad u) + k u = f on (y, x) in [0, 1]^2, u = 0 on the boundary.

    Draw (9 parameters, uniform): log a = sum_i omega_i cos(k_i pi y) cos(l_i pi x) over four
    zero-mean modes, omega_i in ``omega_range`` (default (-0.5, 0.5)); the reaction field
    k = k_0 (1 + bubble / 2), log k_0 uniform in log ``k_range`` (default k_0 in [1, 100]: from
    diffusion-dominated to boundary layers of width ~ 0.1); the source f = sum_i c_i times
    four zero-mean cosine modes, c_i in ``source_range`` (default (-1, 1)).

    Boundary, exact: u = ``output_scale`` * bubble * N, N the network's output and bubble =
    16 x (1 - x) y (1 - y), zero on the walls (default scale 0.02, the size of u).

    Inputs: "log_a", "k", "f", "bubble". Instance norm after the U-Net's first (bias-free)
    convolution removes every channel's spatial mean and any scale common to all channels, so
    each channel carries its draw in its variation: log a and f have zero-mean modes; k_0, a
    number, enters as the field k, whose variation k_0 bubble / 2 is never zero (log k would
    make k_0 a constant shift, erased); "bubble", the same in every draw, is the yardstick
    the other channels' amplitudes are read against.

    Loss: "pde" = the mean over the interior nodes of r^2, r = ``residual(u, inputs)``: the
    flux form of -div(a grad u) with arithmetic face means of a
    (``gridtools.flux_divergence``) plus k u - f. Its zero is the solution of the same scheme
    ``reference_solution`` solves with scipy (a direct sparse solve). ``norm`` "multilevel"
    and "operator" measure r by ``residual_norm`` (the latter with ``norm_options``);
    "vcycle" by ``operator_norm``, a V-cycle of the scheme's own operator (symmetric positive
    definite on the interior nodes: the arithmetic face means are shared by both nodes of a
    face), its ``apply`` the residual's linear part r(v) - r(0).
    """

    name = "helmholtz"
    param_names = (*(f"omega_{i + 1}" for i in range(len(A_MODES))), "log_k0",
                   *(f"c_{i + 1}" for i in range(len(F_MODES))))
    input_channels = ("log_a", "k", "f", "bubble")

    def __init__(self, *, grid=(64, 64), norm="l2", omega_range=(-0.5, 0.5), k_range=(1.0, 100.0),
                 source_range=(-1.0, 1.0), output_scale=0.02):
        super().__init__(grid=grid, norm=norm)
        self.omega_range = gt.interval("omega_range", omega_range)
        self.k_range = gt.interval("k_range", k_range)
        self.source_range = gt.interval("source_range", source_range)
        self.output_scale = float(output_scale)
        if not (self.k_range[0] > 0 and self.output_scale > 0):
            raise ValueError(f"need k_range > 0 and output_scale > 0, got {k_range}, "
                             f"{output_scale}")
        self.fd = FiniteDifference(self.spacing, "central", derivatives=("rr", "cc"))

    def config(self) -> dict:
        return {**super().config(), "omega_range": list(self.omega_range),
                "k_range": list(self.k_range), "source_range": list(self.source_range),
                "output_scale": self.output_scale}

    @property
    def axes(self):
        return (Axis("y", 0.0, 1.0), Axis("x", 0.0, 1.0))

    def param_bounds(self) -> np.ndarray:
        return np.array([self.omega_range] * len(A_MODES) + [np.log(self.k_range)]
                        + [self.source_range] * len(F_MODES))

    def build_input(self, params, dtype=torch.float32) -> torch.Tensor:
        params = self.check_params(params)
        points = mesh(self)
        wall_zero = bubble(self)
        log_a = gt.combine(params[:, :4], gt.cosine_modes(points, A_MODES))
        k = np.exp(params[:, 4])[:, None, None] * (1 + wall_zero / 2)
        f = gt.combine(params[:, 5:], gt.cosine_modes(points, F_MODES))
        return torch.as_tensor(np.stack((log_a, k, f, wall_zero * np.ones_like(f)), 1),
                               dtype=dtype)

    def impose(self, u, inputs):
        return self.output_scale * inputs[:, 3:4] * u

    def residual(self, u, inputs):
        """(B, 1, *block) the scheme's residual at every node of the block (meaningful on the
        interior nodes only: the walls hold u = 0 exactly)."""
        a = inputs[:, :1].exp()
        return gt.flux_divergence(self.fd, self.block, u, a) + inputs[:, 1:2] * u - inputs[:, 2:3]

    def norm_options(self, inputs) -> dict:
        # k = k_0 (1 + bubble / 2), so any node gives k_0; k is between k_0 and 1.5 k_0, and
        # log a has zero mean (a about 1): the reaction relative to a, k_0 times 1.25
        k0 = (inputs[:, 1] / (1 + inputs[:, 3] / 2)).flatten(1)[:, 0]
        return {"coefficient": inputs[:, :1].exp(), "reaction": 1.25 * k0}

    def source(self, x: np.ndarray) -> np.ndarray:
        return x[2]

    def operator(self, x: np.ndarray) -> sp.csr_matrix:
        """Flux-form diffusion plus the reaction field: ``residual``'s scheme."""
        return (gt.flux_operator(np.exp(x[0]), self.spacing) + sp.diags(x[1].ravel())).tocsr()
