"""Darcy flow with a rough random coefficient: the neural-operator benchmark family.

The family of Li et al. (Fourier Neural Operator, 2020) and the benchmarks that followed, with
its coefficient given by spectral coefficients (``random_fields``) so one draw renders on any
grid, and a "fine-scale" high-contrast preset whose solution the 64x64 grid does not resolve.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from diffnet.domain import Block
from diffnet.validation import check_choice, check_int, check_number
from diffnet.problems.contract.blocks import block_coords
from diffnet.problems.families.random_fields import cosine_basis, draw_coefficients, grf_scales, render
from diffnet.problems.families.reaction_diffusion import ReactionDiffusion

# The named configurations (``family``); explicit tau / alpha / a_hi / a_lo override them.
FAMILIES = {
    # the FNO benchmark's values
    "benchmark": {"alpha": 2.0, "tau": 3.0, "a_hi": 12.0, "a_lo": 3.0},
    # contrast 100, correlation length ~1/10: the 64x64 solution is a few % off
    # (lab/notes/readme-second-release.md, "Does the family need the fine grid?")
    "fine-scale": {"alpha": 2.0, "tau": 10.0, "a_hi": 100.0, "a_lo": 1.0},
}
COEFFICIENTS = ("threshold", "lognormal")
MAX_MODES = 256
# Parameter bounds (used to flag extrapolation in --params files): this many standard
# deviations per coefficient, outside which a draw falls with probability 2e-9 per coefficient.
BOUND_SIGMAS = 6.0


class Darcy(ReactionDiffusion):
    """-div(a grad u) = f on (y, x) in [0, 1]^2, u = 0 on the whole boundary, f = ``source``
    (default 1).

    Coefficient (``coefficient``):
      * "threshold" (default): a = a_hi where mu >= 0 and a = a_lo where mu < 0;
      * "lognormal": a = exp(mu);
    with mu a Gaussian random field N(0, tau^(2 alpha - 2) (-Laplacian + tau^2 I)^(-alpha))
    (zero-Neumann cosine eigenfunctions, constant mode removed), truncated at ``modes`` cosines
    per axis and scaled as the FNO data generator scales it (see ``random_fields``):

        mu = sum_{l,k < M} c_lk phi_l(y) phi_k(x),  phi_0 = 1, phi_k = sqrt(2) cos(k pi .),
        c_lk = xi_lk tau^(alpha-1) (pi^2 (l^2 + k^2) + tau^2)^(-alpha/2),  xi ~ N(0, 1), c_00 = 0.

    ``family`` names a preset of (alpha, tau, a_hi, a_lo): "benchmark" (default) = (2, 3, 12, 3),
    the FNO benchmark; "fine-scale" = (2, 10, 100, 1), high contrast and a correlation length
    ~1/10, where the 64x64 solution interpolated to 512x512 is a few percent from the 512x512
    one (lab/notes/readme-second-release.md, "Does the family need the fine grid?"). ``tau``
    (> 0), ``alpha`` (> 1: finite variance in 2-D), ``a_hi``, ``a_lo`` (> 0, threshold only)
    given explicitly override the preset; a ``family`` given anew over stored options
    (``--set`` on a checkpoint) brings its preset's values, unless they are given too
    (``option_presets``).

    Parameters: the M*M coefficients c_lk, row-major over (l, k) (l along y, k along x), named
    "c_l_k"; c_00 is always 0 in the draws. ``sample_params(seed, indices)`` draws them (draw i
    from its own generator seeded by (seed, i), shell by shell, so the 32-mode draw is the
    64-mode draw truncated); ``param_bounds`` is +-6 standard deviations per coefficient
    ([0, 0] for c_00). A parameter vector IS the field mu, whatever the grid: the same draw
    renders (``mu``) on 64x64 for a coarse stage, on 512x512 for the fine one, and for held-out
    draws at every resolution.

    ``modes`` (default 32, at most 256): M. Why 32: it resolves the fine-scale (tau = 10) fields
    at 1024 parameters per draw. The truncation keeps 99.3% of mu's variance at tau = 10
    (99.93% at tau = 3); the shortest half-wavelength, 1/31, is two cells of the 64x64 grid
    (which samples the series without aliasing) and 16 of the 512x512 one; the zero set of mu,
    which alone decides the thresholded a, differs from that of a 256-mode truncation of the
    same draws on 2.8% of the 512x512 nodes (1.4% with 64 modes), next to the interfaces. What
    needs the fine grid is the threshold itself -- interfaces anywhere between the coarse nodes,
    at contrast 100 -- not modes beyond the coarse grid: with 32 modes the 64x64 solution,
    interpolated, is a median 3.3% from the 512x512 one for "fine-scale" (0.48% for
    "benchmark"); with 64 modes 4.2% (0.50%). More modes are allowed (the draws are nested).

    Sampling at the nodes: mu is evaluated exactly at each node (the cosine series, not an
    interpolation) and a takes the value of its side of the threshold there (mu = 0 exactly
    counts as a_hi, as in the FNO generator), so a is piecewise constant on the node grid and
    its interfaces lie between nodes. The diffusion energy and the reference solver both put on
    the face between two nodes the harmonic mean 2 a_1 a_2 / (a_1 + a_2) -- the exact
    conductivity of two half-cells in series -- so flux across an interface is limited by the
    low side, as it physically is (an arithmetic mean would leak through a_lo barriers).

    Input channels ("nu", "log_nu"): a at the nodes (called nu, as in the other elliptic
    families, so a coefficient array is given as the field "nu" to ``deepfusion infer
    --inputs``; "log_nu" is derived from it) and log a (two-valued for "threshold", mu for
    "lognormal").

    ``impose`` (u = 0 on the boundary, exact), ``bc_mode`` ("overwrite" / "lift"),
    ``output_scale`` (u ~ f / (8 a), so ~0.01 for these families), ``ritz``, ``ritz_fields``,
    ``ritz_partition``, ``quadrature`` and ``stencil``: as ``ReactionDiffusion`` (this is its
    kappa = 0 case with another coefficient), and so is the exact split of impose and loss on a
    block of the grid (``on_block``).

    Loss: "pde" = the energy E(u) = integral of a |grad u|^2 / 2 - f u (diffusion part by the
    "faces" two-point-flux quadrature with harmonic face averages, source by the lumped
    trapezoidal rule); its discrete minimiser is the reference finite-volume solution, so the
    energy is the only loss: a strong-form residual would need div(a grad u), whose a-jumps put
    a measure on the interfaces that a nodal stencil does not see (the residual loss of
    ``Poisson`` is not offered). "bc" = 0 (hard-imposed). Minimum E* = -(1/2) integral f u*.

    Reference: ``diffnet.reference.solve_diffusion`` (vertex-centred finite volumes, harmonic
    faces, "direct" SuperLU or "amg" pyamg + CG; "auto" = direct up to 256^2 unknowns).
    """

    name = "darcy"
    residual_threshold = 0.4     # of answer_residual: docs/answer-check.md says how chosen
    # config() writes the preset's values out (a checkpoint reloads exactly); a family given
    # anew on it (--set) must still bring its own values: replace_options drops these
    option_presets = {"family": ("tau", "alpha", "a_hi", "a_lo")}

    def __init__(self, *, grid=(64, 64), family: str = "benchmark", tau=None, alpha=None,
                 a_hi=None, a_lo=None, coefficient: str = "threshold", modes: int = 32,
                 source: float = 1.0, quadrature: str = "faces", stencil: str = "sobel",
                 bc_mode: str = "overwrite", output_scale: float = 1.0, ritz: bool = False,
                 ritz_fields: int = 1, ritz_partition: int = 0):
        super().__init__(grid=grid, kappa=0.0, source=source, quadrature=quadrature,
                         stencil=stencil, bc_mode=bc_mode, output_scale=output_scale, ritz=ritz,
                         ritz_fields=ritz_fields, ritz_partition=ritz_partition)
        # The KL parameters of the base are not this family's: removed, so reading them fails.
        del self.n_terms, self.omega_range
        self.family = check_choice("family", family, tuple(FAMILIES))
        preset = FAMILIES[self.family]
        self.tau = check_number("tau", preset["tau"] if tau is None else tau, lo=0.0,
                                lo_open=True)
        self.alpha = check_number("alpha", preset["alpha"] if alpha is None else alpha,
                                  lo=1.0, lo_open=True,
                                  what="a finite number > 1 (mu has finite variance in 2-D)")
        self.coefficient = check_choice("coefficient", coefficient, COEFFICIENTS)
        if self.coefficient == "lognormal":
            if a_hi is not None or a_lo is not None:
                raise ValueError(f"a_hi and a_lo are the two values of coefficient='threshold'; "
                                 f"coefficient='lognormal' (a = exp(mu)) takes neither, got "
                                 f"a_hi={a_hi!r}, a_lo={a_lo!r}")
            self.a_hi = self.a_lo = None
        else:
            self.a_hi = check_number("a_hi", preset["a_hi"] if a_hi is None else a_hi,
                                     lo=0.0, lo_open=True)
            self.a_lo = check_number("a_lo", preset["a_lo"] if a_lo is None else a_lo,
                                     lo=0.0, lo_open=True)
        self.modes = check_int("modes", modes, 2, MAX_MODES)
        m = self.modes
        self.param_names = tuple(f"c_{l}_{k}" for l in range(m) for k in range(m))

    def config(self) -> dict:
        cfg = {"grid": list(self.grid), "family": self.family, "coefficient": self.coefficient,
               "tau": self.tau, "alpha": self.alpha, "modes": self.modes,
               "source": self.source, "quadrature": self.quadrature, "stencil": self.stencil,
               "bc_mode": self.bc_mode, "output_scale": self.output_scale, "ritz": self.ritz,
               "ritz_fields": self.head.channels, "ritz_partition": self.partition}
        if self.coefficient == "threshold":
            cfg.update(a_hi=self.a_hi, a_lo=self.a_lo)
        return cfg

    # -- parameters: the spectral coefficients of mu ---------------------------------------------
    def param_bounds(self) -> np.ndarray:
        s = BOUND_SIGMAS * grf_scales(self.modes, self.tau, self.alpha).ravel()
        return np.stack([-s, s], axis=1)

    def sample_params(self, seed: int, indices) -> np.ndarray:
        return draw_coefficients(seed, indices, self.modes, self.tau, self.alpha)

    def mu(self, params: np.ndarray, block: Block | None = None) -> np.ndarray:
        """(n, H, W) float64 Gaussian field mu at the nodes of parameter vectors (n, M*M); at
        the nodes of ``block`` alone when given."""
        return render(self.check_params(params), *block_coords(self, block))

    def coefficient_of(self, mu: np.ndarray) -> np.ndarray:
        """a of a field mu (any shape): the two values of the threshold, or exp(mu)."""
        if self.coefficient == "lognormal":
            return np.exp(mu)
        return np.where(mu >= 0.0, self.a_hi, self.a_lo)

    def nu_range(self) -> tuple[float, float]:
        """The extreme values of a: (a_lo, a_hi) sorted, or for "lognormal" exp(-+ b) with b
        the largest |mu| over the parameter box (|phi_l phi_k| <= 2), a loose bound."""
        if self.coefficient == "threshold":
            return min(self.a_lo, self.a_hi), max(self.a_lo, self.a_hi)
        sup = cosine_basis(self.modes, [0.0])[0]                 # 1, sqrt 2, sqrt 2, ...
        b = float((np.abs(self.param_bounds()[:, 1]) * np.outer(sup, sup).ravel()).sum())
        return math.exp(-b), math.exp(b)

    # -- fields ----------------------------------------------------------------------------------
    def log_nu(self, params: np.ndarray, block: Block | None = None) -> np.ndarray:
        mu = self.mu(params, block)
        return mu if self.coefficient == "lognormal" else np.log(self.coefficient_of(mu))

    def nu_nodes(self, params: np.ndarray) -> np.ndarray:
        """(H, W) float64 a of one parameter vector: the exact values, not exp(log a)."""
        return self.coefficient_of(self.mu(np.asarray(params, dtype=np.float64).reshape(1, -1)))[0]

    def build_block_input(self, params: np.ndarray, block: Block,
                          dtype=torch.float32) -> torch.Tensor:
        """a and log a at ``block``'s nodes alone: ``render`` evaluates the modes at the
        block's coordinates; each node's value is a sum over the modes that the matrix
        products add in the same order whatever the number of nodes, so these are the whole
        grid's values bit for bit (tests/test_block_inputs.py checks it)."""
        mu = self.mu(params, block)
        a = self.coefficient_of(mu)
        lg = mu if self.coefficient == "lognormal" else np.log(a)
        return torch.as_tensor(np.stack([a, lg], axis=1), dtype=dtype)
