"""The lab plugin ``poisson_operator_residual`` (the built-in Poisson with loss = "residual",
residual_norm = "operator"): its loss is zero at the reference solution and
about the energy error elsewhere (operator_norm / 2 of the energy's gradient, within the
V-cycle's band), and its gradient is the energy's up to that band."""
from __future__ import annotations

import numpy as np
import torch

from lab.plugins.poisson_operator_residual import PoissonOperatorResidual


def test_loss_is_the_energy_error_within_the_band():
    p = PoissonOperatorResidual(grid=(40, 40), bc_mode="lift")
    params = p.sample_params(0, range(3))
    x = p.build_input(params, dtype=torch.float64)
    nu = x[:, 0:1]
    ref = torch.tensor(np.stack([p.reference_solution(q) for q in params])).unsqueeze(1)
    assert float(p.loss_terms(ref, x)["pde"].abs().max()) < 1e-20
    g = torch.Generator().manual_seed(0)
    y = torch.linspace(0, 1, 40, dtype=torch.float64)
    for e in (1e-2 * torch.randn(ref.shape, generator=g, dtype=torch.float64),
              1e-2 * torch.sin(np.pi * y).view(1, 1, 1, 40).expand_as(ref).clone()):
        e[..., [0, -1]] = 0                                # the Dirichlet columns stay exact
        u = (ref + e).requires_grad_(True)
        pde = p.loss_terms(u, x)["pde"]
        error = p.diffusion_energy(u.detach(), nu) - p.diffusion_energy(ref, nu)
        ratio = pde.detach() / error
        assert bool(((ratio > 0.5) & (ratio <= 1 + 1e-9)).all()), ratio
        (grad,) = torch.autograd.grad(pde.sum(), u)
        v = u.detach().requires_grad_(True)
        (energy_grad,) = torch.autograd.grad(p.diffusion_energy(v, nu).sum(), v)
        grad, energy_grad = grad[..., 1:-1], energy_grad[..., 1:-1]     # the unknowns
        cos = (grad * energy_grad).sum() / (grad.norm() * energy_grad.norm())
        assert cos > 0.5, cos


def test_plugin_is_the_builtin_option_whatever_the_recipe_says():
    from diffnet.problems import get_problem
    p = PoissonOperatorResidual(grid=(16, 16), bc_mode="lift", loss="energy")
    q = get_problem("poisson", grid=(16, 16), bc_mode="lift", loss="residual",
                    residual_norm="operator")
    x = p.build_input(p.sample_params(0, range(2)), dtype=torch.float64)
    raw = torch.randn(2, 1, 16, 16, generator=torch.Generator().manual_seed(2),
                      dtype=torch.float64)
    assert (p.loss, p.residual_norm) == ("residual", "operator")
    assert torch.equal(p.loss_terms(p.answer(raw, x), x)["pde"],
                       q.loss_terms(q.answer(raw, x), x)["pde"])
