"""The conservative residual of the "faces" diffusion energy (``KLDiffusionProblem``): its
gradient written in closed form, r = dE/du / vol with vol = prod(h), i.e. the vertex-centred
finite-volume -div(nu grad u) of the reference solver (five-point in 2-D, seven-point in 3-D,
harmonic face nu, half cells on the boundary rows), so the zero of r at the free nodes is the
reference solution. Poisson's ``loss = "residual"`` with ``residual_norm = "operator"``
measures it by ``operator_norm`` (``poisson.Poisson`` says why this form).

``FacesOperator(problem, nu)`` is v -> dE/dv / vol for the fixed nu. E is quadratic with no
source, so its gradient is linear in v and symmetric (a quadratic form's gradient) of stencil
radius 1: the same call gives the residual of u and the operator ``apply`` that
``operator_norm`` probes.

Why closed form rather than autograd through E: the residual is then an ordinary function of
u (no double backward per step), and it is exact on a split block from one halo of v per call
(the face coefficients from one halo of nu, once). A node's two faces along an axis are its
own and its neighbour's; the halo's ghosts beyond the grid are zero, and the harmonic mean of
a zero ghost nu is zero, so a face outside the grid carries no flux: the zero-flux walls are
the energy's natural condition and their rows are equations like any other.
"""
from __future__ import annotations

import functools
import math
import operator

import torch

from diffnet.problems.contract.blocks import lines_along
from diffnet.problems.families.diffusion import axis_weights, harmonic_mean


class FacesOperator:
    """v -> dE/dv / vol on ``problem``'s block, E the "faces" energy of ``problem`` with the
    diffusivity ``nu`` (B, 1, *shape) at the block's nodes; v (B, 1, *shape) likewise. On a
    split block, every block must call it (it exchanges a halo)."""

    def __init__(self, problem, nu: torch.Tensor):
        self.block = problem.block
        self.scale = 2.0 / math.prod(problem.spacing)       # d(w d^2)/dd = 2 w d
        padded = self.block.halo(nu.contiguous(), 1)
        weights = [problem.part(w) for w in axis_weights(problem.grid, nu)]
        self.coefficients = []      # per axis: the faces' weights w, one more than the nodes
        for a, (h, n) in enumerate(zip(problem.spacing, problem.grid)):
            line = lines_along(padded, self.block, a)
            k = harmonic_mean(line.narrow(2 + a, 1, line.shape[2 + a] - 1),
                              line.narrow(2 + a, 0, line.shape[2 + a] - 1))
            # as ``KLDiffusionProblem``'s edge pairs: midpoint along the axis, trapezoid across
            across = functools.reduce(operator.mul,
                                      [w for b, w in enumerate(weights) if b != a])
            self.coefficients.append(k * (0.5 / ((n - 1) * h * h)) * across)

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        padded = self.block.halo(v.contiguous(), 1)
        out = 0
        for a, w in enumerate(self.coefficients):
            flux = w * torch.diff(lines_along(padded, self.block, a), dim=2 + a)  # w (v[i + 1] - v[i])
            n = self.block.shape[a]
            out = out + (flux.narrow(2 + a, 0, n) - flux.narrow(2 + a, 1, n))
        return self.scale * out
