"""A benchmark family of your own: anisotropic diffusion in a random rotated tensor, its mixed
derivative on the 9-point stencil.

Written with the public API only (``diffnet.problems.Problem``, ``Axis``, the stencil
``diffnet.stencils.FiniteDifference`` and the problem's split-exact helpers) and the shared
pieces of ``gridtools``. With ``examples/families`` on the PYTHONPATH a config names it
``problem.name = "anisotropic:Anisotropic"``; examples/families/README.md has the commands.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch

import gridtools as gt
from diffnet.problems import Axis, bubble, mesh
from diffnet.stencils import FiniteDifference

F_MODES = ((0, 1), (1, 0), (1, 1), (2, 2))   # (k_y, k_x) of the source's modes cos(k_y pi y) cos(k_x pi x)


def tensor(theta, eps):
    """(K_yy, K_xy, K_xx) of K = R(theta) diag(1, eps) R(theta)^T: diffusivity 1 along the
    direction at angle theta from the x axis, eps across it."""
    s, c = np.sin(theta), np.cos(theta)
    return s * s + eps * c * c, (1 - eps) * s * c, c * c + eps * s * s


class Anisotropic(gt.ResidualFamily):
    """-div(K grad u) = f on (y, x) in [0, 1]^2, u = 0 on the boundary, K constant.

    Draw (6 parameters, uniform): K = R(theta) diag(1, eps) R(theta)^T, theta in [0, pi) the
    angle of the fast direction from the x axis, eps in ``eps_range`` (default (0.05, 1));
    the source f = sum_i c_i times four zero-mean cosine modes, c_i in ``source_range``
    (default (-1, 1)).

    Boundary, exact: u = ``output_scale`` * bubble * N, N the network's output and bubble =
    16 x (1 - x) y (1 - y), zero on the walls (default scale 0.04, the size of u).

    Inputs: "K_yy", "K_xy", "K_xx", "kq", "f", "bubble". Instance norm after the U-Net's first
    (bias-free) convolution removes every channel's spatial mean and any scale common to all
    channels: a constant channel reaches the network as nothing. So the three entries of K,
    constant, are there for the loss and the solver alone; the network sees K as the
    quadratic kq = p^T K p / 2, p = (y, x) - 1/2, whose Hessian is K: ellipses along the fast
    direction, their aspect ratio sqrt(eps). "bubble", the same in every draw, is the yardstick
    the other channels' amplitudes are read against.

    Loss: "pde" = the mean over the interior nodes of r^2, r = ``residual(u, inputs)`` =
    -(K_yy u_yy + 2 K_xy u_yx + K_xx u_xx) - f by central differences, the mixed one
    (u[i+1, j+1] - u[i+1, j-1] - u[i-1, j+1] + u[i-1, j-1]) / (4 hy hx): the 9-point scheme
    ``reference_solution`` solves with scipy (a direct sparse solve).
    """

    name = "anisotropic"
    param_names = ("theta", "eps", *(f"c_{i + 1}" for i in range(len(F_MODES))))
    input_channels = ("K_yy", "K_xy", "K_xx", "kq", "f", "bubble")
    loss_only_channels = ("K_yy", "K_xy", "K_xx")     # constant: the loss reads them, not the net

    def __init__(self, *, grid=(64, 64), norm="l2", eps_range=(0.05, 1.0),
                 source_range=(-1.0, 1.0), output_scale=0.04):
        super().__init__(grid=grid, norm=norm)
        self.eps_range = gt.interval("eps_range", eps_range)
        self.source_range = gt.interval("source_range", source_range)
        self.output_scale = float(output_scale)
        if not (self.eps_range[0] > 0 and self.eps_range[1] <= 1 and self.output_scale > 0):
            raise ValueError(f"need 0 < eps_range <= 1 and output_scale > 0, got {eps_range}, "
                             f"{output_scale}")
        self.fd = FiniteDifference(self.spacing, "central", derivatives=("rr", "rc", "cc"))

    def config(self) -> dict:
        return {**super().config(), "eps_range": list(self.eps_range),
                "source_range": list(self.source_range), "output_scale": self.output_scale}

    @property
    def axes(self):
        return (Axis("y", 0.0, 1.0), Axis("x", 0.0, 1.0))

    def param_bounds(self) -> np.ndarray:
        return np.array([(0.0, np.pi), self.eps_range] + [self.source_range] * len(F_MODES))

    def build_input(self, params, dtype=torch.float32) -> torch.Tensor:
        params = self.check_params(params)
        y, x = points = mesh(self)
        k_yy, k_xy, k_xx = (k[:, None, None] for k in tensor(params[:, 0], params[:, 1]))
        kq = 0.5 * (k_yy * (y - 0.5)**2 + 2 * k_xy * (y - 0.5) * (x - 0.5) + k_xx * (x - 0.5)**2)
        f = gt.combine(params[:, 2:], gt.cosine_modes(points, F_MODES))
        ones = np.ones_like(f)
        fields = (k_yy * ones, k_xy * ones, k_xx * ones, kq, f, bubble(self) * ones)
        return torch.as_tensor(np.stack(fields, 1), dtype=dtype)

    def impose(self, u, inputs):
        return self.output_scale * inputs[:, 5:6] * u

    def residual(self, u, inputs):
        """(B, 1, *block) the scheme's residual at every node of the block (meaningful on the
        interior nodes only: the walls hold u = 0 exactly)."""
        d = self.fd(u, self.block)          # u_yy, u_yx, u_xx
        k = inputs[:, :3]
        flux = (k[:, 0:1] * d[:, 0:1] + 2 * k[:, 1:2] * d[:, 1:2] + k[:, 2:3] * d[:, 2:3])
        return -flux - inputs[:, 4:5]

    def source(self, x: np.ndarray) -> np.ndarray:
        return x[4]

    def operator(self, x: np.ndarray) -> sp.csr_matrix:
        """-(K_yy D_yy + 2 K_xy D_y D_x + K_xx D_xx): ``residual``'s 9-point scheme."""
        (hy, hx), (ny, nx) = self.spacing, self.grid
        d_y = gt.along(gt.first_difference(ny, hy), 0, self.grid)
        d_x = gt.along(gt.first_difference(nx, hx), 1, self.grid)
        parts = (gt.along(gt.second_difference(ny, hy), 0, self.grid), 2 * d_y @ d_x,
                 gt.along(gt.second_difference(nx, hx), 1, self.grid))
        return -sum(sp.diags(k.ravel()) @ m for k, m in zip(x[:3], parts)).tocsr()
