"""Poisson's conservative residual loss (``loss = "residual"``, ``residual_norm = "operator"``):
its residual is the "faces" energy's gradient / h^2 (2-D and 3-D), zero at the reference
solution; the loss is about the energy error (operator_norm / 2, within the V-cycle's band);
its value and gradient on split grids are the undivided ones (float64, threads standing in
for ranks; real MPI in tests/mpi_scripts/split_loss_check.py); combinations that cannot work
are refused with the fix."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from diffnet.problems import get_problem
from diffnet.problems.check.split import close, split_run, undivided
from diffnet.problems.families.faces_residual import FacesOperator

OPTIONS = dict(loss="residual", residual_norm="operator")


def sample(p, n=2, seed=0):
    """Inputs (float64) of n draws and their reference solutions (n, 1, *grid)."""
    params = p.sample_params(seed, range(n))
    x = p.build_input(params, dtype=torch.float64)
    ref = torch.tensor(np.stack([p.reference_solution(q) for q in params])).unsqueeze(1)
    return x, ref


@pytest.mark.parametrize("name,grid", [("poisson", (16, 16)), ("poisson", (13, 10)),
                                       ("poisson3d", (6, 7, 8))])
def test_residual_is_the_energy_gradient_and_zero_at_the_reference(name, grid):
    p = get_problem(name, grid=grid, bc_mode="lift", **OPTIONS)
    x, ref = sample(p)
    nu = x[:, 0:1]
    u = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1),
                    dtype=torch.float64).requires_grad_()
    (g,) = torch.autograd.grad(p.diffusion_energy(u, nu).sum(), u)
    r = FacesOperator(p, nu)(u.detach())
    assert close(r, g / math.prod(p.spacing), rtol=1e-12, atol=0)
    at_ref = p.loss_terms(ref, x)
    assert float(at_ref["pde"].abs().max()) < 1e-20, at_ref["pde"]
    assert float(p.loss_terms(u.detach(), x)["pde"].min()) > 1.0         # away from it, not zero
    assert torch.equal(at_ref["bc"], torch.zeros(2, dtype=torch.float64))


def test_loss_is_the_energy_error_within_the_band():
    p = get_problem("poisson", grid=(24, 24), bc_mode="lift", **OPTIONS)
    x, ref = sample(p, 3)
    nu = x[:, 0:1]
    y = torch.linspace(0, 1, 24, dtype=torch.float64)
    for e in (1e-2 * torch.randn(ref.shape, generator=torch.Generator().manual_seed(0),
                                 dtype=torch.float64),
              1e-2 * torch.sin(np.pi * y).view(1, 1, 1, 24).expand_as(ref).clone()):
        e[..., [0, -1]] = 0                                # the Dirichlet columns stay exact
        pde = p.loss_terms(ref + e, x)["pde"]
        error = p.diffusion_energy(ref + e, nu) - p.diffusion_energy(ref, nu)
        ratio = pde / error
        assert bool(((ratio > 0.5) & (ratio <= 1 + 1e-9)).all()), ratio


@pytest.mark.parametrize("bc_mode", ["lift", "overwrite"])
@pytest.mark.parametrize("split", [(1, 2), (2, 2)], ids=str)
def test_split_value_and_gradient_are_the_undivided_ones(split, bc_mode):
    make = lambda: get_problem("poisson", grid=(16, 16), bc_mode=bc_mode,   # noqa: E731
                               **OPTIONS)
    p = make()
    x, _ = sample(p)
    raw = (0.4 + 0.3 * torch.randn((2, 1, 16, 16), generator=torch.Generator().manual_seed(3),
                                   dtype=torch.float64)).requires_grad_()
    ref_u, ref = undivided(p, raw, x)
    got_u, got = split_run(make, split, raw, x)
    assert torch.equal(got_u, ref_u)
    value, grad = ref["pde"]
    assert float(value.min()) > 0 and float(grad.abs().max()) > 0
    for k in ref:
        assert close(got[k][0], ref[k][0], rtol=1e-12), (k, got[k][0], ref[k][0])
        assert close(got[k][1], ref[k][1], rtol=1e-12), k


def test_the_nodes_quadrature_is_refused_with_the_fix():
    with pytest.raises(ValueError, match='set quadrature = "faces"'):
        get_problem("poisson", grid=(16, 16), quadrature="nodes", **OPTIONS)
    with pytest.raises(ValueError, match="operator"):
        get_problem("poisson", grid=(16, 16), loss="residual", residual_norm="energy")
    p = get_problem("poisson", grid=(16, 16), quadrature="nodes", residual_norm="operator")
    assert p.loss == "energy"          # the energy loss never reads residual_norm


def test_config_round_trip_names_the_option():
    p = get_problem("poisson", grid=(16, 16), bc_mode="lift", **OPTIONS)
    assert p.config()["residual_norm"] == "operator" and p.config()["loss"] == "residual"
    q = get_problem("poisson", **p.config())
    x, ref = sample(q)
    assert torch.equal(q.loss_terms(ref + 0.01, x)["pde"], p.loss_terms(ref + 0.01, x)["pde"])
