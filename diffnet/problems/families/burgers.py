"""The stochastic inviscid Burgers family of the DiffNet talk (its finite-volume residuals,
undivided and on a block of a split grid, live in ``burgers_fv``)."""
from __future__ import annotations

import numpy as np
import torch

from diffnet.domain import Block
from diffnet.generators import impose_dirichlet
from diffnet.primitive import node_primitive
from diffnet.stencils import KINDS, FiniteDifference, check_block_sizes
from diffnet.validation import check_bool, check_choice, check_int, check_number, check_range
from diffnet.problems.contract.answer_check import characteristic_residual
from diffnet.problems.contract.base import Problem
from diffnet.problems.contract.family import Axis
from diffnet.problems.contract.blocks import block_coords, mean_part
from diffnet.problems.families.burgers_fv import FiniteVolumeResiduals
from diffnet.problems.families.lax_oleinik import basin_targets, lax_oleinik_nodes, lax_oleinik_value, smoothing_points

FORMS = ("conservative", "advective")
SCHEMES = ("stencil", "upwind", "muscl", "lax-oleinik")
REFERENCES = ("exact", "godunov")
LIMITERS = ("minmod", "vanleer", "mc", "superbee")
T_END = 1.0 / 3.0


def initial_condition(c: float, x: np.ndarray) -> np.ndarray:
    """u0(x) = 0.5 (1 - cos(2 pi c x))."""
    return 0.5 * (1.0 - np.cos(2.0 * np.pi * c * np.asarray(x, dtype=np.float64)))


class Burgers(FiniteVolumeResiduals, Problem):
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

    ``scheme`` selects how the residual R is discretised:
        "stencil" (default): the pointwise residual above, derivatives by the fixed 3x3
               FiniteDifference kernels (``stencil``, ``form``, ``viscosity`` apply).
        "upwind": R[i] = (u[i] - u[i-1]) / dt + L1(u[i-1]) on rows i >= 1, columns j >= 1, with
               L1 the first-order conservative finite-volume operator (F[j+1/2] - F[j-1/2]) / dx
               with the Engquist-Osher flux F(uL, uR) = max(uL, 0)^2/2 + min(uR, 0)^2/2 (the
               Godunov flux when u >= 0). Its zero is the explicit Godunov scheme: monotone, it
               selects the entropy solution, but smears shocks over several cells.
        "muscl": R[i] = (u[i] - Phi(u[i-1])) / dt, Phi = one SSP-RK2 (Heun) step of the MUSCL
               scheme: piecewise-linear reconstruction with slope limiter ``limiter``
               ("minmod", "vanleer", "mc" (default), "superbee"), Engquist-Osher flux.
               Second order where smooth, TVD (CFL = dt/dx max|u| = 1/3 on a square grid),
               conservative (Rankine-Hugoniot speed) and entropy-satisfying, so the loss has ONE
               zero -- the classical shock-capturing solution on this grid -- and no smooth
               decaying field can undercut it (the central residual at a resolved shock is
               O(1/h), which is what made the optimiser prefer a smeared, wrong field).
        "lax-oleinik": no residual; the "pde" term is the mean over rows t > 0 of the
               Lax-Oleinik functional of each node's value, the variational principle of the
               entropy solution (Evans, PDE, 3.4.2):
                   g(u; x, t) = (U0(x - u t) - U0(x)) / t + u^2 / 2,    U0(y) = int_0^y u0,
               with u0 extended by the inflow value 0 for y < 0 (``diffnet.primitive``: U0 from
               the u0 input row, fourth order, C1 between nodes). dg/du = u - u0(x - u t) is the
               characteristic equation, and the global minimiser over u is the exact entropy
               solution (u = (x - y*)/t, y* the winning characteristic foot), shocks included:
               a shock is a node-to-node switch between two minima, with no smearing. Behind a
               shock g has two local minima; a node caught in the wrong one puts the shock a node
               off. ``smoothing`` (default 0: off) s0 > 0 replaces g by its Gaussian average
               E[g(u + s Z)] (8-point Gauss-Hermite) with s falling linearly from s0 to 0 at the
               fraction ``smoothing_until`` (default 0.7) of training (``set_progress``), so
               early training sees one wide basin around the deeper minimum (a homotopy); the
               final loss is g itself. ``basin_weight`` (default 0: off) w > 0 adds
               w * mean (u - target)^2, target the value among the node's own and its
               x-neighbours' (up to ``basin_reach`` nodes each side, default 2) that gives this
               node the lowest g (no gradient through it): a node in the wrong basin is a local
               minimum of g, which no gradient of g moves, but its neighbour across the shock
               holds the other basin's value and wins the comparison (``basin_targets``).
        Ghost states for both finite-volume schemes: 0 left of x = 0 (the inflow value), copies
        of the last node right of x = 1 (transmissive outflow); nodes are cell centres.
        Row 0 and column 0 carry no residual (they are the initial / inflow conditions, "bc").
        ``viscosity`` must be 0 with these schemes (they bring their own numerical viscosity).
    ``horizon`` (default 1; finite-volume schemes only): the "pde" term is the mean over
    k = 1, 2, 4, ... <= horizon of the k-step residuals (u[i] - Phi^k(u[i-k])) / (k dt), rows
    i >= k. Every k has the same zero (the scheme's solution); k > 1 penalises directly the drift
    that k small one-step residuals accumulate (the one-step loss is ill-conditioned: a residual
    r on every row moves row i by ~ i dt r). horizon = H - 1 makes the longest term compare the
    last row with the scheme marched from the initial condition.
    ``row_weight`` (default 0: off) weights residual row i by exp(-row_weight * t_i / T) (t
    normalised to [0, 1]), normalised to mean 1: a fixed causal emphasis on early times.
    ``reference`` selects ``reference_solution``: "exact" (default; the Lax-Oleinik solution,
    ``solve_burgers_exact``) or "godunov" (first-order Godunov on an 8x finer grid, which
    smears each shock over a few fine cells and is 4-7% (rel L2) from the exact solution on 64^2).
    With ``hard_bc=True`` ``impose`` writes u0 into row t=0 and 0 into column x=0 exactly
    (impose_dirichlet), and "bc" is then identically zero.

    Domain parallelism (``on_block``): every scheme splits exactly. "stencil" through the
    block's ``FiniteDifference`` (boundary blocks need >= 4 nodes per axis); "lax-oleinik" by
    gathering the u0 row along x (the primitive is computed on the whole row); "upwind" and
    "muscl" by a halo of 2k resp. 4k layers for the k-step residuals (``burgers_fv``), so
    ``on_block`` refuses a horizon whose halo is wider than the blocks' shortest side.
    "bc" counts row t = 0 and column x = 0 on the blocks holding them.

    ``reference_methods`` = ("auto",): neither reference solver has a choice to make. Solving
    from given fields (``solve_from_inputs``) is not available: both solvers follow u0 between
    the nodes (characteristic feet, Gauss points), so they take u0 as a function of x, which a
    sampled u0 row does not determine; give the parameter c instead.
    """

    name = "burgers"
    param_names = ("c",)
    input_channels = ("u0", "t")
    derivations = {"t": "the normalised time of its row, 0 on the first row to 1 on the last",
                   "u0": "its first row (t = 0) repeated on every row"}
    residual_threshold = 0.06    # of answer_residual: docs/answer-check.md says how chosen

    def __init__(self, *, grid=(64, 64), c_range=(3.0, 6.0), bc_weight: float = 10.0,
                 hard_bc: bool = False, stencil: str = "sobel", form: str = "conservative",
                 viscosity: float = 0.0, scheme: str = "stencil", limiter: str = "mc",
                 row_weight: float = 0.0, horizon: int = 1, smoothing: float = 0.0,
                 smoothing_until: float = 0.7, reference: str = "exact",
                 basin_weight: float = 0.0, basin_reach: int = 2):
        super().__init__(grid=grid)
        self.c_range = check_range("c_range", c_range)
        if self.c_range[0] <= 0:
            raise ValueError(f"c_range must lie in c > 0 (the frequency of u0), got {c_range!r}")
        self.bc_weight = check_number("bc_weight", bc_weight, lo=0.0)
        self.hard_bc = check_bool("hard_bc", hard_bc)
        self.stencil = check_choice("stencil", stencil, KINDS)
        self.form = check_choice("form", form, FORMS)
        self.viscosity = check_number("viscosity", viscosity, lo=0.0)
        self.scheme = check_choice("scheme", scheme, SCHEMES)
        self.limiter = check_choice("limiter", limiter, LIMITERS)
        self.row_weight = check_number("row_weight", row_weight, lo=0.0)
        horizon = check_int("horizon", horizon, 1)
        if horizon > 1 and self.scheme not in ("upwind", "muscl"):
            raise ValueError(f"horizon > 1 needs scheme='upwind' or 'muscl' (scheme is "
                             f"{self.scheme!r}), got {horizon!r}")
        self.horizon = horizon
        self.smoothing = check_number("smoothing", smoothing, lo=0.0)
        if self.smoothing > 0 and self.scheme != "lax-oleinik":
            raise ValueError(f"smoothing > 0 needs scheme='lax-oleinik' (scheme is "
                             f"{self.scheme!r}), got {smoothing!r}")
        self.smoothing_until = check_number("smoothing_until", smoothing_until, lo=0.0, hi=1.0,
                                            lo_open=True)
        self.reference = check_choice("reference", reference, REFERENCES)
        self.basin_weight = check_number("basin_weight", basin_weight, lo=0.0)
        self.basin_reach = check_int("basin_reach", basin_reach, 1)
        # the basin target is held fixed (no gradient through it), and it is part of "pde"
        self.detached_terms = ("pde",) if self.basin_weight > 0 else ()
        if self.basin_weight > 0 and self.scheme != "lax-oleinik":
            raise ValueError(f"basin_weight > 0 needs scheme='lax-oleinik' (scheme is "
                             f"{self.scheme!r}), got {basin_weight!r}")
        self.progress = 0.0
        if self.scheme != "stencil" and self.viscosity > 0:
            raise ValueError(f"viscosity must be 0 with scheme={self.scheme!r} (finite-volume "
                             f"schemes carry their own numerical viscosity), got {viscosity!r}")
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
                "form": self.form, "viscosity": self.viscosity, "scheme": self.scheme,
                "limiter": self.limiter, "row_weight": self.row_weight, "horizon": self.horizon,
                "smoothing": self.smoothing, "smoothing_until": self.smoothing_until,
                "reference": self.reference, "basin_weight": self.basin_weight,
                "basin_reach": self.basin_reach}

    def set_progress(self, fraction: float) -> None:
        self.progress = float(fraction)

    def current_smoothing(self) -> float:
        """The smoothing width now: ``smoothing`` falling linearly to 0 at ``smoothing_until``."""
        return self.smoothing * max(0.0, 1.0 - self.progress / self.smoothing_until)

    # -- fields -----------------------------------------------------------------------------
    def build_input(self, params: np.ndarray, dtype=torch.float32) -> torch.Tensor:
        """(n, 2, H, W): u0 on every row, and the normalised time t / T in [0, 1]."""
        return self.build_block_input(params, Block(self.grid), dtype)

    def build_block_input(self, params: np.ndarray, block: Block,
                          dtype=torch.float32) -> torch.Tensor:
        """The inputs at ``block``'s nodes alone: u0 at its x nodes, t / T on its rows."""
        params = self.check_params(params)
        _, x = block_coords(self, block)
        (r0, _), (h, w) = block.start, block.shape
        u0 = initial_condition(params[:, :1], x[None, :])               # (n, w)
        out = np.empty((params.shape[0], 2, h, w), dtype=np.float64)
        out[:, 0] = u0[:, None, :]
        out[:, 1] = np.linspace(0.0, 1.0, self.grid[0])[None, r0:r0 + h, None]
        return torch.as_tensor(out, dtype=dtype)

    def derived_channels(self, inputs: np.ndarray) -> dict[str, np.ndarray]:
        """t / T from the grid's rows; u0 from its first row (the network sees it on every
        row)."""
        u0 = inputs[:, self.input_channels.index("u0")]
        t = np.linspace(0.0, 1.0, u0.shape[1])[None, :, None]
        return {"u0": np.broadcast_to(u0[:, :1], u0.shape), "t": np.broadcast_to(t, u0.shape)}

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
        row, both = (self.part(t) for t in self._mask(u))
        # values: u0 on row 0 (u0(0) = 0, and the row mask zeroes every other node), so the
        # column x = 0 receives 0.
        return impose_dirichlet(u, both, inputs[:, 0:1] * row)

    # -- losses -----------------------------------------------------------------------------
    def check_block(self, block) -> None:
        if self.scheme == "stencil":
            check_block_sizes(block)
        elif self.scheme != "lax-oleinik":
            self.check_fv_block(block)

    def _row_weights(self, like: torch.Tensor) -> torch.Tensor:
        key = ("w", like.dtype, like.device)
        if key not in self._masks:
            h = self.grid[0]
            t = torch.linspace(0, 1, h, dtype=torch.float64)
            w = torch.exp(-self.row_weight * t)
            w = w / w.mean()
            self._masks[key] = w.to(like.dtype).to(like.device).view(1, 1, h, 1)
        return self._masks[key]

    def pde_residual(self, u: torch.Tensor) -> torch.Tensor:
        """(B, 1, H, W) residual R(u) on every node (see the class docstring); on a split
        block, the block's part of the residual field."""
        if self.scheme == "lax-oleinik":
            raise ValueError("scheme='lax-oleinik' minimises a functional and has no residual "
                             "R(u); use loss_terms(u, inputs)")
        if self.scheme != "stencil":
            return self.fv_residuals(u, (1,))[0]
        b = u.shape[0]
        if self.form == "conservative":
            d = self.fd(torch.cat([u, 0.5 * u * u], dim=0), self.block)
            r = d[:b, 0:1] + d[b:, 1:2]
        else:
            d = self.fd(u, self.block)
            r = d[:, 0:1] + u * d[:, 1:2]
        if self.viscosity > 0:
            r = r - self.viscosity * d[:b, 2:3]
        return r

    def _basin(self, v: torch.Tensor, geometry: tuple) -> torch.Tensor:
        """(B,) mean over rows t > 0 of (u - target)^2, target the node's best neighbour value
        (``basin_targets``): the pull that moves a shock node into the deeper basin. ``v``,
        ``geometry``: from ``_lo_nodes``."""
        blk = self.block
        with torch.no_grad():   # a node's neighbours may sit on the next block: the whole x row
            rows = blk.gather(v.detach(), axis=1)
        big_u0, u0, _, t, _, dx = geometry
        x = torch.arange(self.grid[1], dtype=v.dtype, device=v.device) * dx
        geometry = (big_u0, u0, x, t, big_u0[:, None, :], dx)
        target = basin_targets(rows, lambda c: lax_oleinik_value(c, *geometry),
                               self.basin_reach)
        target = target[..., blk.start[1]:blk.start[1] + blk.shape[1]]
        h, w = self.grid
        return mean_part((v - target).square(), (1, 2), (h - 1) * w, self.block)

    def _lo_nodes(self, u: torch.Tensor, inputs: torch.Tensor):
        """The node values v on rows t > 0 and the arguments of ``lax_oleinik_nodes`` after v,
        which gives the per-node functional g(u) (class docstring), (B, H-1, W).

        On a split block: the block's nodes on rows t > 0 (global row index), (B, h', w). The
        primitive needs the whole u0 row, so the block gathers it along x and every block
        computes the undivided ``node_primitive`` (bit-identical to it)."""
        dt, dx = self.spacing
        blk = self.block
        first = int(blk.at_lo(0))                  # skip the local first row iff it is t = 0
        u0 = blk.gather(inputs[:, 0, 0, :], axis=1)      # (B, W): the whole row
        big_u0 = node_primitive(u0, dx)            # (B, W), once for all quadrature points
        t = blk.indices(0, u)[first:, None].to(u.dtype) * dt
        x = blk.indices(1, u).to(u.dtype) * dx
        v = u[:, 0, first:, :]
        here = big_u0[:, None, blk.start[1]:blk.start[1] + blk.shape[1]]   # U0 at this block's x
        return v, (big_u0, u0, x, t, here, dx)

    def loss_terms(self, u: torch.Tensor, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        h, w = self.grid
        if self.scheme == "lax-oleinik":
            v, geometry = self._lo_nodes(u, inputs)     # once: on a split it gathers u0
            g = lax_oleinik_nodes(v, *geometry, smoothing_points(self.current_smoothing()))
            if self.row_weight > 0:
                g = g * self.part(self._row_weights(u))[:, 0, int(self.block.at_lo(0)):]
            pde = mean_part(g, (1, 2), (h - 1) * w, self.block)
            if self.basin_weight > 0:
                pde = pde + self.basin_weight * self._basin(v, geometry)
            return {"pde": pde, "bc": self._bc(u, inputs)}
        rs = self.fv_residuals(u) if self.scheme != "stencil" else [self.pde_residual(u)]
        if self.row_weight > 0:
            rs = [r * self.part(self._row_weights(r)).sqrt() for r in rs]
        pde = sum(self.mean(r.square()) for r in rs) / len(rs)
        return {"pde": pde, "bc": self._bc(u, inputs)}

    def _bc(self, u: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        # u = u0 on the row t = 0 (channel 0 holds u0 on every row), u = 0 on the column x = 0
        bc = (self.wall_mean((u - inputs[:, 0:1]).square(), 0, "lo")
              + self.wall_mean(u.square(), 1, "lo"))
        return self.bc_weight * bc

    def answer_residual(self, u, inputs) -> np.ndarray:
        """(B,) ||u - u0(x - u t)|| / ||u0|| over the nodes, the characteristic equation
        (``answer_check``), whatever ``scheme`` the network was trained with."""
        return characteristic_residual(self, u, inputs)

    def reference_solution(self, params: np.ndarray, method: str = "auto") -> np.ndarray:
        from diffnet.reference import solve_burgers, solve_burgers_exact

        self.check_method(method)
        c_arr = np.asarray(params, dtype=np.float64).reshape(-1)
        if c_arr.size != 1 or not np.isfinite(c_arr[0]) or c_arr[0] <= 0:
            raise ValueError(f"burgers: params must be one vector (c,) with c > 0, got {params!r}")
        c = float(c_arr[0])
        h, w = self.grid
        if self.reference == "godunov":
            return solve_burgers(lambda x: initial_condition(c, x), x_nodes=w, t_nodes=h,
                                 t_end=T_END)
        return solve_burgers_exact(lambda x: initial_condition(c, x), x_nodes=w, t_nodes=h,
                                   t_end=T_END)
