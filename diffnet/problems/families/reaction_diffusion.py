"""Reaction-diffusion family: log-normal KL diffusivity, fixed reaction and source; its energy
is a ``QuadraticEnergy``, so it answers through a Ritz head with option ``ritz``."""
from __future__ import annotations

import torch

from diffnet.validation import check_bool, check_choice, check_int, check_number
from diffnet.problems.families.diffusion import KLDiffusionProblem
from diffnet.problems.contract.heads import Plain, QuadraticEnergy, Ritz


class ReactionDiffusion(KLDiffusionProblem, QuadraticEnergy):
    """-div(nu grad u) + kappa^2 u = f on (y, x) in [0, 1]^2, u = 0 on the whole boundary.

    Family: nu = the same KL log-normal diffusivity as ``Poisson`` (``n_terms`` default 4,
    omega_i uniform in ``omega_range`` default (-3, 3), nu in [0.010, 99.5]); kappa fixed
    (``kappa``, default 5, so the reaction kappa^2 = 25 competes with diffusion pi^2 nu and
    low-nu regions develop boundary layers of width ~ sqrt(nu) / kappa); the source f is the
    constant ``source`` (default 1). param_names = ("omega_1", ..., "omega_m").

    Input channels ("nu", "log_nu"). ``impose`` always makes u = 0 on the boundary exact:
    ``bc_mode = "overwrite"`` (default) returns u = output_scale * raw with the boundary nodes
    zeroed (so a boundary layer one cell wide costs the network nothing); ``"lift"`` returns
    u = output_scale * 16 x (1 - x) y (1 - y) * raw, smooth up to the walls.
    ``output_scale`` (default 1) sets the size of the network's output (u ~ f / kappa^2 here).
    ``ritz`` (default False): the answer head (``diffnet.problems.contract.heads.Ritz``) is then the
    energy's minimiser in the span of the network's fields, each with its boundary values
    imposed (the numerics: ``diffnet.problems.contract.ritz``): with ``ritz_fields`` K = 1 (default) c u,
    c = l(u) / a(u, u) per sample; with K > 1 the network outputs K fields (the problem's
    ``output_channels``) and their Galerkin combination is the answer. The network then only
    has to span the solution: the amplitudes, global properties (for Darcy, the effective
    conductivity of the whole medium), are what energy training converges to slowest, being
    the energy's flattest directions. ``ritz_partition`` m > 0 (default 0) makes the K
    coefficients bilinear fields on an m x m coarse grid, found by the Galerkin solve in the
    span of the fields times the (m + 1)^2 hats (``Partition``): amplitudes corrected region by
    region, never a higher energy than m = 0 (the "faces" quadrature only).

    Loss: "pde" = the energy

        E(u) = integral of  nu |grad u|^2 / 2 + kappa^2 u^2 / 2 - f u

    over the square (diffusion part by ``quadrature``, default the "faces" two-point-flux rule,
    see ``KLDiffusionProblem``; the reaction and source terms by the trapezoidal nodal rule, i.e.
    a lumped mass). Its Euler-Lagrange equation is exactly the PDE above, and its discrete
    minimiser is the reference finite-volume solution. NOTE: the talk's functional without the
    1/2 factors, integral of nu |grad u|^2 + kappa^2 u^2 - f u, is minimised by the solution of
    -div(nu grad u) + kappa^2 u = f / 2 (half the source), a different equation. "bc" = 0
    (hard-imposed). The energy is negative at the minimum (E* = -(1/2) integral f u*).

    Domain parallelism: impose and the energy split exactly, every quadrature and ``bc_mode``
    (``on_block``; the masks and nodal weights are the global ones cut to the block).
    """

    name = "reaction_diffusion"
    residual_threshold = 0.4     # of answer_residual: docs/answer-check.md says how chosen

    def __init__(self, *, grid=(64, 64), n_terms: int = 4, omega_range=(-3.0, 3.0),
                 kappa: float = 5.0, source: float = 1.0, quadrature: str = "faces",
                 stencil: str = "sobel", bc_mode: str = "overwrite", output_scale: float = 1.0,
                 ritz: bool = False, ritz_fields: int = 1, ritz_partition: int = 0):
        super().__init__(grid=grid, n_terms=n_terms, omega_range=omega_range,
                         quadrature=quadrature, stencil=stencil)
        self.ritz = check_bool("ritz", ritz)
        fields = check_int("ritz_fields", ritz_fields, 1, 16)
        if fields > 1 and not self.ritz:
            raise ValueError(f"ritz_fields = {ritz_fields} combines the network's fields by the "
                             f"Ritz-Galerkin solve, which needs ritz = true; set ritz = true or "
                             f"ritz_fields = 1")
        self.partition = self._check_partition(ritz_partition)
        self.head = Ritz(fields, self.partition) if self.ritz else Plain()
        if self.partition:
            self.head.partition_of(self.grid)      # built with the problem, not at a first answer
        self.kappa = check_number("kappa", kappa, lo=0.0)
        self.bc_mode = check_choice("bc_mode", bc_mode, ("overwrite", "lift"))
        self.output_scale = check_number("output_scale", output_scale, lo=0.0)
        self.source = check_number("source", source, what="a finite number")
        self._masks: dict = {}

    def config(self) -> dict:
        return {**super().config(), "kappa": self.kappa, "source": self.source,
                "bc_mode": self.bc_mode, "output_scale": self.output_scale, "ritz": self.ritz,
                "ritz_fields": self.head.channels, "ritz_partition": self.partition}

    def _check_partition(self, m) -> int:
        m = check_int("ritz_partition", m, 0, min(self.grid) - 1)
        if m and not self.ritz:
            raise ValueError(f"ritz_partition = {m} makes the Ritz coefficients fields, which "
                             f"needs ritz = true; set ritz = true or ritz_partition = 0")
        if m and self.quadrature != "faces":
            raise ValueError(f"ritz_partition = {m} assembles the Gram matrix cell by cell, "
                             f"which needs the two-point 'faces' quadrature, not "
                             f"quadrature = {self.quadrature!r}; set quadrature = \"faces\" "
                             f"or ritz_partition = 0")
        return m

    def _interior(self, like: torch.Tensor) -> torch.Tensor:
        key = (like.dtype, like.device)
        if key not in self._masks:
            h, w = self.grid
            m = torch.zeros((1, 1, h, w), dtype=like.dtype, device=like.device)
            m[..., 1:-1, 1:-1] = self.output_scale
            self._masks[key] = m
        return self._masks[key]

    def impose(self, u: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        # impose_dirichlet(u, boundary, 0) * scale == u * (scale * interior): one multiply.
        mask = self._bubble(u) if self.bc_mode == "lift" else self._interior(u)
        return u * self.part(mask)

    # -- the quadratic energy the Ritz head minimises (heads.QuadraticEnergy) -----------------
    def load(self, inputs: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The nodal weights of l(v) = integral of f v: f times the trapezoidal weights."""
        return self.source * self.part(self._weights(like)[2])

    def linear_form(self, u: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """(B, K) integral of f u_i, as ``integrate`` takes it (the K fields as one batch)."""
        b, k = u.shape[:2]
        return self.integrate(u.reshape(b * k, 1, *u.shape[2:]) * self.source).view(b, k)

    def quadratic_features_window(self, u: torch.Tensor, inputs: torch.Tensor, start,
                                  stop) -> list:
        """``quadratic_features`` of a window of the whole grid (``diffusion_features_window``:
        the edges and nodes it owns)."""
        pairs = self.diffusion_features_window(u, inputs[:, 0:1].to(u.dtype), start, stop)
        if self.kappa == 0:
            return pairs
        (y0, x0), (y1, x1) = start, stop
        wn = self._weights(u)[2][..., y0:y1, x0:x1]
        return pairs + [(u[..., :y1 - y0, :x1 - x0], (0.5 * self.kappa ** 2) * wn)]

    def quadratic_features(self, u: torch.Tensor, inputs: torch.Tensor) -> list:
        """a(u, u) / 2 = integral of nu |grad u|^2 / 2 + kappa^2 u^2 / 2 (this block's part on
        a split) as weighted squares, for the K fields of u (B, K, *grid) (see
        ``diffusion_features``); nu is channel 0 of ``inputs`` (or ``inputs`` is nu)."""
        pairs = self.diffusion_features(u, inputs[:, 0:1].to(u.dtype))
        if self.kappa == 0:     # Darcy: a zero-weight pair would add a third to G's products
            return pairs
        return pairs + [(u, (0.5 * self.kappa ** 2) * self.part(self._weights(u)[2]))]

    def _bubble(self, like: torch.Tensor) -> torch.Tensor:
        key = ("bubble", like.dtype, like.device)
        if key not in self._masks:
            h, w = self.grid
            y = torch.linspace(0.0, 1.0, h, dtype=like.dtype, device=like.device).view(1, 1, -1, 1)
            x = torch.linspace(0.0, 1.0, w, dtype=like.dtype, device=like.device).view(1, 1, 1, -1)
            self._masks[key] = self.output_scale * 16 * x * (1 - x) * y * (1 - y)
        return self._masks[key]

    def loss_terms(self, u: torch.Tensor, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        energy = self.diffusion_energy(u, inputs[:, 0:1])
        energy = energy + self.integrate(u * (0.5 * self.kappa ** 2 * u - self.source))
        return {"pde": energy, "bc": torch.zeros_like(energy)}

    def diffusion_options(self) -> dict:
        return {"kappa": self.kappa, "f": self.source, "dirichlet": "all_zero"}
