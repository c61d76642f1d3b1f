"""The built-in Poisson trained on the gradient of its own discrete energy, measured in the
multilevel norm: a residual form whose zero is exactly the reference (finite-volume) solution,
with the Neumann walls' equations included, to tell whether the norm itself trains as well as
the energy (issue #68), apart from the non-conservative Sobel residual of ``loss =
"residual"``. A lab study plugin, whole grid only:

    deepfusion train configs/recipes/poisson.toml \\
        --set 'problem.name="lab.plugins.poisson_gradient_residual:PoissonGradientResidual"'

r = dE/du / h^2 at every node, E the "faces" energy (integral of nu |grad u|^2 / 2), i.e.
-div(nu grad u) of the five-point finite-volume scheme (half cells on the walls); the Dirichlet
columns x = 0, 1 do not count, the zero-flux rows y = 0, 1 do. Measured by
``residual_norm(r, self, coefficient=nu, interior=(0, 1))``. The gradient is taken with
``create_graph=True``, so a step costs a double backward through the energy.
"""
from __future__ import annotations

import math

import torch

from diffnet.problems import Poisson, residual_norm


class PoissonGradientResidual(Poisson):
    """Poisson (the built-in), its loss the multilevel norm of its energy's gradient."""

    name = "poisson_gradient_residual"

    def check_block(self, block) -> None:
        super().check_block(block)
        if not block.whole:
            raise ValueError("this lab plugin trains on the whole grid only (the energy's "
                             "gradient at a block's edge needs its neighbours' edges)")

    def loss_terms(self, u: torch.Tensor, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        nu = inputs[:, 0:1]
        with torch.enable_grad():
            v = u if u.requires_grad else u.detach().requires_grad_(True)
            energy = self.diffusion_energy(v, nu)
            (g,) = torch.autograd.grad(energy.sum(), v, create_graph=u.requires_grad)
        r = g / math.prod(self.spacing)
        pde = residual_norm(r, self, coefficient=nu, interior=(0,) * (self.dims - 1) + (1,))
        return {"pde": pde, "bc": torch.zeros_like(pde)}
