"""A PDE family of your own, outside DeepFusion: steady heat conduction with a random source.

Written only with the public contract (``diffnet.problems.Problem``, ``Axis``), the problem's
split-exact helpers (``self.edges``, ``self.part``) and plain torch, so it also trains with
each sample split over ranks (``parallel.domain``). With this directory on the PYTHONPATH,
a config names it ``problem.name = "heat:Heat"``::

    PYTHONPATH=examples deepfusion problems heat:Heat

The walk-through: docs/your-own-pde.md.
"""
from __future__ import annotations

import numpy as np
import torch

from diffnet.problems import Axis, Problem

MODES = ((1, 1), (2, 1))   # (k, l): the source's sine modes sin(k pi x) sin(l pi y)


class Heat(Problem):
    """Steady heat conduction -(u_xx + u_yy) = f on (y, x) in [0, 1]^2, u = 0 on the boundary.

    The source is f = a_1 sin(pi x) sin(pi y) + a_2 sin(2 pi x) sin(pi y), with the amplitudes
    a_1, a_2 uniform in ``amplitude_range``. ``amplitude_range`` is the interval both amplitudes
    are drawn from (default (0.5, 1.5)). The boundary value is imposed exactly (the network's
    output times zero on the boundary), so "bc" is zero; "pde" is the discrete energy
    sum over grid edges of |grad u|^2 / 2 minus the sum over nodes of f u (times the cell area),
    whose minimiser is the 5-point finite-difference solution. Each sine mode is an exact
    eigenvector of the 5-point Laplacian, so the reference solution divides each amplitude by
    its discrete eigenvalue: exact for the discrete equation.
    """

    name = "heat"
    param_names = ("a_1", "a_2")
    input_channels = ("f",)
    loss_term_names = ("pde", "bc")
    reference_methods = ("auto",)

    def __init__(self, *, grid=(16, 16), amplitude_range=(0.5, 1.5)):
        super().__init__(grid=grid)
        lo, hi = (float(v) for v in amplitude_range)
        if not lo < hi:
            raise ValueError(f"amplitude_range must be (lo, hi) with lo < hi, got {amplitude_range}")
        self.amplitude_range = (lo, hi)

    def config(self) -> dict:
        return {**super().config(), "amplitude_range": list(self.amplitude_range)}

    @property
    def axes(self):
        return (Axis("y", 0.0, 1.0), Axis("x", 0.0, 1.0))

    def param_bounds(self) -> np.ndarray:
        return np.array([self.amplitude_range] * len(MODES), dtype=np.float64)

    def _modes(self):
        c = self.coords()
        y, x = np.meshgrid(c["y"], c["x"], indexing="ij")
        return [np.sin(k * np.pi * x) * np.sin(m * np.pi * y) for k, m in MODES]

    def build_input(self, params, dtype=torch.float32) -> torch.Tensor:
        params = np.asarray(params, dtype=np.float64).reshape(-1, len(MODES))
        f = np.einsum("nk,khw->nhw", params, np.stack(self._modes()))
        return torch.as_tensor(f[:, None], dtype=dtype)

    def impose(self, u, inputs):
        # u = 0 on the boundary, exactly; the factor brings the network's O(1) output to the
        # solution's size (f = sin(pi x) sin(pi y) gives u = f / (2 pi^2))
        mask = torch.zeros(self.grid, dtype=u.dtype, device=u.device)
        mask[1:-1, 1:-1] = 1 / (2 * np.pi**2)
        return u * self.part(mask)          # the global mask, cut to this block

    def loss_terms(self, u, inputs):
        # The discrete Dirichlet energy: its minimiser over the interior values is exactly the
        # 5-point finite-difference solution, and it trains far better than a squared residual.
        # self.edges: the edges this block owns, each edge of the grid once over the blocks
        hy, hx = self.spacing
        (y0, y1), (x0, x1) = self.edges(u)
        dx, dy = x1 - x0, y1 - y0
        dims = tuple(range(1, u.dim()))
        energy = (0.5 * (hy / hx) * dx.pow(2).sum(dims) + 0.5 * (hx / hy) * dy.pow(2).sum(dims)
                  - hx * hy * (inputs[:, :1] * u).sum(dims))
        return {"pde": energy, "bc": torch.zeros_like(energy)}

    def reference_solution(self, params, method: str = "auto") -> np.ndarray:
        self.check_method(method)
        hy, hx = self.spacing
        u = 0.0
        for a, mode, (k, m) in zip(np.asarray(params, dtype=np.float64), self._modes(), MODES):
            lam = 4 / hx**2 * np.sin(k * np.pi * hx / 2)**2 + 4 / hy**2 * np.sin(m * np.pi * hy / 2)**2
            u = u + a / lam * mode
        return np.asarray(u, dtype=np.float64)
