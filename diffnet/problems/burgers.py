"""The stochastic inviscid Burgers family of the DiffNet talk."""
from __future__ import annotations

import numpy as np
import torch

from ..generators import impose_dirichlet
from ..stencils import KINDS, FiniteDifference
from .base import Axis, Problem, check_bool, check_choice, check_number, check_range

FORMS = ("conservative", "advective")
T_END = 1.0 / 3.0


def initial_condition(c: float, x: np.ndarray) -> np.ndarray:
    """u0(x) = 0.5 (1 - cos(2 pi c x))."""
    return 0.5 * (1.0 - np.cos(2.0 * np.pi * c * np.asarray(x, dtype=np.float64)))


class Burgers(Problem):
    """Inviscid Burgers: u_t + u u_x = 0 on (t, x) in [0, 1/3] x [0, 1].

    Conditions: u(0, t) = 0 (inflow at x = 0), u(x, 0) = u0(x) = 0.5 (1 - cos(2 pi c x)), with
    the one parameter c uniform in ``c_range`` (param_names = ("c",)). x = 1 is an outflow
    boundary (u >= 0 everywhere, characteristics leave there): no condition. Every c >= 1/pi
    makes a shock before t = 1/3 (breaking time 1 / (pi c) ~ 0.106 for c = 3).

    Fields are (t_nodes, x_nodes): axes = (t in [0, 1/3], x in [0, 1]); row 0 is t = 0.

    Network input, channels ("u0", "t"):
        "u0": u0(x) broadcast along t (every row is the initial condition);
        "t":  the normalised time coordinate t / (1/3) in [0, 1] (row i holds i / (H - 1)), so
              the network knows where the initial row is without relying on zero padding.

    Loss L = L_p + bc_weight * L_b, per sample:
        "pde": mean over ALL grid nodes of the squared residual R(u)^2 with
               ``form="conservative"`` (default): R = u_t + (u^2/2)_x - viscosity * u_xx,
               ``form="advective"``:               R = u_t + u u_x      - viscosity * u_xx.
               Both are the same PDE for smooth u; the conservative form is the one whose
               weak solutions satisfy the Rankine-Hugoniot shock speed, so it is the default
               (discretely, the central (u^2/2)_x is the neighbour average of u times the
               central u_x). Derivatives by ``FiniteDifference(kind=stencil)`` (one conv call
               on u and u^2/2 stacked along the batch). ``viscosity`` (default 0) is an
               optional artificial viscosity that smooths the shock over a few cells.
        "bc":  bc_weight * ( mean_x (u(x, 0) - u0(x))^2 + mean_t u(0, t)^2 ).
    With ``hard_bc=True`` ``impose`` writes u0 into row t=0 and 0 into column x=0 exactly
    (impose_dirichlet), and "bc" is then identically zero.
    """

    name = "burgers"
    param_names = ("c",)
    input_channels = ("u0", "t")

    def __init__(self, *, grid=(64, 64), c_range=(3.0, 6.0), bc_weight: float = 10.0,
                 hard_bc: bool = False, stencil: str = "sobel", form: str = "conservative",
                 viscosity: float = 0.0):
        super().__init__(grid=grid)
        self.c_range = check_range("c_range", c_range)
        if self.c_range[0] <= 0:
            raise ValueError(f"c_range must lie in c > 0 (the frequency of u0), got {c_range!r}")
        self.bc_weight = check_number("bc_weight", bc_weight, lo=0.0)
        self.hard_bc = check_bool("hard_bc", hard_bc)
        self.stencil = check_choice("stencil", stencil, KINDS)
        self.form = check_choice("form", form, FORMS)
        self.viscosity = check_number("viscosity", viscosity, lo=0.0)
        derivs = ("r", "c", "cc") if self.viscosity > 0 else ("r", "c")
        self.fd = FiniteDifference(self.spacing, self.stencil, derivatives=derivs)
        self._masks: dict = {}

    @property
    def axes(self) -> tuple[Axis, Axis]:
        return (Axis("t", 0.0, T_END), Axis("x", 0.0, 1.0))

    def param_bounds(self) -> np.ndarray:
        return np.array([self.c_range], dtype=np.float64)

    def config(self) -> dict:
        return {"grid": list(self.grid), "c_range": list(self.c_range),
                "bc_weight": self.bc_weight, "hard_bc": self.hard_bc, "stencil": self.stencil,
                "form": self.form, "viscosity": self.viscosity}

    # -- fields -----------------------------------------------------------------------------
    def build_input(self, params: np.ndarray, dtype=torch.float32) -> torch.Tensor:
        params = self.check_params(params)
        h, w = self.grid
        x = self.coords()["x"]
        u0 = initial_condition(params[:, :1], x[None, :])               # (n, W)
        out = np.empty((params.shape[0], 2, h, w), dtype=np.float64)
        out[:, 0] = u0[:, None, :]
        out[:, 1] = np.linspace(0.0, 1.0, h)[None, :, None]
        return torch.as_tensor(out, dtype=dtype)

    def _mask(self, like: torch.Tensor):
        """(row-0 mask, row-0-or-column-0 mask), (1, 1, H, W), cached per dtype/device."""
        key = (like.dtype, like.device)
        if key not in self._masks:
            h, w = self.grid
            row = torch.zeros((1, 1, h, w), dtype=like.dtype, device=like.device)
            row[..., 0, :] = 1
            both = row.clone()
            both[..., :, 0] = 1
            self._masks[key] = (row, both)
        return self._masks[key]

    def impose(self, u: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        if not self.hard_bc:
            return u
        row, both = self._mask(u)
        # values: u0 on row 0 (u0(0) = 0, and the row mask zeroes every other node), so the
        # column x = 0 receives 0.
        return impose_dirichlet(u, both, inputs[:, 0:1] * row)

    # -- losses -----------------------------------------------------------------------------
    def pde_residual(self, u: torch.Tensor) -> torch.Tensor:
        """(B, 1, H, W) residual R(u) on every node (see the class docstring)."""
        b = u.shape[0]
        if self.form == "conservative":
            d = self.fd(torch.cat([u, 0.5 * u * u], dim=0))
            r = d[:b, 0:1] + d[b:, 1:2]
        else:
            d = self.fd(u)
            r = d[:, 0:1] + u * d[:, 1:2]
        if self.viscosity > 0:
            r = r - self.viscosity * d[:b, 2:3]
        return r

    def loss_terms(self, u: torch.Tensor, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        r = self.pde_residual(u)
        pde = r.square().mean(dim=(1, 2, 3))
        u0 = inputs[:, 0, 0, :]
        bc = (u[:, 0, 0, :] - u0).square().mean(dim=1) + u[:, 0, :, 0].square().mean(dim=1)
        return {"pde": pde, "bc": self.bc_weight * bc}

    def reference_solution(self, params: np.ndarray) -> np.ndarray:
        from ..reference import solve_burgers

        c_arr = np.asarray(params, dtype=np.float64).reshape(-1)
        if c_arr.size != 1 or not np.isfinite(c_arr[0]) or c_arr[0] <= 0:
            raise ValueError(f"burgers: params must be one vector (c,) with c > 0, got {params!r}")
        c = float(c_arr[0])
        h, w = self.grid
        return solve_burgers(lambda x: initial_condition(c, x), x_nodes=w, t_nodes=h,
                             t_end=T_END)
