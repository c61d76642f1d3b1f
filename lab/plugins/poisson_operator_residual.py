"""The built-in Poisson trained on the gradient of its own discrete energy (as
``poisson_gradient_residual``), measured by the operator-preconditioned norm ``operator_norm``
(a V-cycle of the energy's own Hessian) instead of the Laplacian's BPX norm: does a norm
equivalent to the energy for any coefficient train as well as the energy (issue #68, round 3)?
A lab study plugin, whole grid only:

    deepfusion train configs/recipes/poisson.toml \\
        --set 'problem.name="lab.plugins.poisson_operator_residual:PoissonOperatorResidual"'

r = dE/du / h^2 at every node (the five-point finite-volume -div(nu grad u), half cells on the
walls); ``apply`` is the same gradient of a field v (E is quadratic with no source, so its
gradient is linear: A v); the Dirichlet columns x = 0, 1 are not unknowns (``interior=(0,
1)``). "pde" = operator_norm / 2: about the energy error e^T A e / 2, with gradient about the
energy's (exactly so if the V-cycle were an exact solve).
"""
from __future__ import annotations

import math

import torch

from diffnet.problems import operator_norm
from lab.plugins.poisson_gradient_residual import PoissonGradientResidual


class PoissonOperatorResidual(PoissonGradientResidual):
    """Poisson (the built-in), its loss the V-cycle norm of its energy's gradient."""

    name = "poisson_operator_residual"

    def energy_gradient(self, u: torch.Tensor, nu: torch.Tensor, graph: bool) -> torch.Tensor:
        """dE/du / h^2 at every node; with ``graph``, differentiable in u."""
        with torch.enable_grad():
            v = u if u.requires_grad else u.detach().requires_grad_(True)
            (g,) = torch.autograd.grad(self.diffusion_energy(v, nu).sum(), v, create_graph=graph)
        return g / math.prod(self.spacing)

    def loss_terms(self, u: torch.Tensor, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        nu = inputs[:, 0:1].detach()
        r = self.energy_gradient(u, nu, u.requires_grad)
        apply = lambda v: self.energy_gradient(v, nu, False)   # noqa: E731 (E has no source)
        pde = 0.5 * operator_norm(r, self, apply, interior=(0,) * (self.dims - 1) + (1,))
        return {"pde": pde, "bc": torch.zeros_like(pde)}
