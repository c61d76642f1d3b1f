"""The benchmark families of examples/families/, each a user's PDE written with the public API:
the contract (check-problem, the split included), the tie between loss and reference solver
(the reference's residual, by the family's own ``residual``, is rounding), second-order
convergence of the reference scheme on a manufactured solution, and a tiny training and
evaluation of each through the deepfusion command, in this process.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import sympy as sym
import torch

from diffnet.problems import get_problem, mesh
from diffnet.problems.check.problem import check_problem
from tests.mpi_util import ROOT

FAMILIES = os.path.join(ROOT, "examples", "families")
if FAMILIES not in sys.path:
    sys.path.insert(0, FAMILIES)      # what PYTHONPATH=examples/families does

import gridtools as gt  # noqa: E402
from anisotropic import tensor  # noqa: E402

SPECS = {"adr": "adr:ADR", "helmholtz": "helmholtz:Helmholtz",
         "anisotropic": "anisotropic:Anisotropic", "diffusion3d": "diffusion3d:Diffusion3D"}
TINY_GRIDS = {"diffusion3d": (8, 8, 8)}


@pytest.mark.parametrize("family", SPECS)
def test_the_family_keeps_the_contract_split_included(family):
    report = check_problem(SPECS[family]).assert_ok()
    assert any(r.check.startswith("split [2, 2") and r.status == "OK" for r in report.results)


@pytest.mark.parametrize("family", SPECS)
def test_the_reference_solves_the_losss_own_residual_to_rounding(family):
    p = get_problem(SPECS[family], grid=TINY_GRIDS.get(family, (16, 16)))
    params = p.sample_params(3, range(2))
    x = p.build_input(params, torch.float64)
    inner = (slice(None), 0, *(slice(1, -1),) * p.dims)
    for i in range(2):
        ref = torch.as_tensor(p.reference_solution(params[i]))[None, None]
        r = p.residual(ref, x[i:i + 1])[inner].abs().max()
        # the size of the equations: the residual of the lift alone (the network's output 0)
        scale = p.residual(p.impose(torch.zeros_like(ref), x[i:i + 1]), x[i:i + 1])[inner]
        assert r <= 1e-11 * scale.abs().max(), (family, float(r))
        assert p.loss_terms(ref, x[i:i + 1])["pde"] <= (1e-11 * scale.abs().max()) ** 2


# -- manufactured solutions: the coefficients as channels, the source from the operator ----------
Z, Y, X = sym.symbols("z y x")


def div_a_grad(a, u, axes):
    return -sum(sym.diff(a * sym.diff(u, t), t) for t in axes)


def manufactured(family):
    """(channels {index: expression}, the operator applied to u*, u*) of ``family``."""
    log_a = 0.3 * sym.sin(X + 2 * Y)
    a = sym.exp(log_a)
    u = sym.sin(2 * X + Y) * sym.exp(X) + Y * Y
    if family == "adr":
        b_y, b_x = 1.5, -2.0
        lu = div_a_grad(a, u, (Y, X)) + b_y * sym.diff(u, Y) + b_x * sym.diff(u, X) + u
        return {0: log_a, 1: b_y, 2: b_x}, lu, u
    if family == "helmholtz":
        k = 5 + X * Y
        return {0: log_a, 1: k}, div_a_grad(a, u, (Y, X)) + k * u, u
    if family == "anisotropic":
        k_yy, k_xy, k_xx = (float(k) for k in tensor(0.6, 0.2))
        lu = -(k_yy * sym.diff(u, Y, 2) + 2 * k_xy * sym.diff(u, Y, X) + k_xx * sym.diff(u, X, 2))
        return {0: k_yy, 1: k_xy, 2: k_xx}, lu, u
    log_a = 0.3 * sym.sin(X + 2 * Y - Z)
    u = sym.sin(2 * X + Y) * sym.exp(X - Z)
    return {0: log_a}, div_a_grad(sym.exp(log_a), u, (Z, Y, X)) + u, u


def nodal(expr, points):
    symbols = (Z, Y, X)[-len(points):]
    return np.broadcast_to(sym.lambdify(symbols, expr, "numpy")(*points), points[0].shape)


def discrete_error(family, n: int) -> float:
    p = get_problem(SPECS[family], grid=(n,) * (3 if family == "diffusion3d" else 2))
    channels, lu, u = manufactured(family)
    points = mesh(p)
    x = p.build_input(p.sample_params(0, [0]), torch.float64)[0].numpy()
    for c, expr in channels.items():
        x[c] = nodal(expr, points)
    exact = nodal(u, points)
    got = gt.dirichlet_solve(p.operator(x), nodal(lu, points), exact, symmetric=p.dims == 3)
    return float(np.abs(got - exact).max())


@pytest.mark.parametrize("family", SPECS)
def test_the_reference_scheme_converges_at_second_order(family):
    coarse = 9 if family == "diffusion3d" else 17
    errors = [discrete_error(family, n) for n in (coarse, 2 * coarse - 1)]   # h, h / 2
    assert 3.5 < errors[0] / errors[1] < 4.5, (family, errors)


# -- a tiny training and evaluation of each, through the command ----------------------------------
@pytest.mark.parametrize("family", SPECS)
def test_each_family_trains_and_evaluates_against_its_reference(family, cli, tmp_path):
    d = str(tmp_path / family)
    grid = list(TINY_GRIDS.get(family, (16, 16)))
    depth = 1 if family == "diffusion3d" else 2
    rc, out, err = cli(["train", os.path.join(FAMILIES, f"{family}.toml"),
                        "--set", f"problem.grid={grid}",
                        "--set", f"model.options={{depth = {depth}, base_width = 4}}",
                        "--set", "data.n_samples=4", "--set", "data.global_batch=2",
                        "--set", "data.eval_samples=2", "--set", "train.max_steps=2",
                        "--set", "parallel.threads_per_rank=1", "--set", f"run.dir={d}"])
    assert rc == 0, err
    rc, out, err = cli(["evaluate", d, "--samples", "2"])
    assert rc == 0, err
    files = [f for f in os.listdir(d) if f.startswith("eval") and f.endswith(".json")]
    report = json.load(open(os.path.join(d, files[0])))
    assert report["n"] == 2 and all(np.isfinite(report["rel_l2"]))


SYMMETRIC = ("helmholtz", "anisotropic", "diffusion3d")


@pytest.mark.parametrize("family", SYMMETRIC)
def test_the_energy_of_a_symmetric_family_is_least_at_its_reference(family):
    """norm = "energy" (``residual_energy``): the reference solution is the energy's
    minimiser, its gradient zero and any admissible change raising it."""
    p = get_problem(SPECS[family], grid=TINY_GRIDS.get(family, (16, 16)), norm="energy")
    params = p.sample_params(3, range(1))
    x = p.build_input(params, torch.float64)
    ref = torch.as_tensor(p.reference_solution(params[0]))[None, None]
    u = ref.clone().requires_grad_(True)
    energy = p.loss_terms(u, x)["pde"]
    (grad,) = torch.autograd.grad(energy.sum(), u)
    bump = p.impose(torch.randn_like(ref), x) - p.impose(torch.zeros_like(ref), x)
    assert grad.abs().max() <= 1e-9 * bump.abs().max()
    assert float(p.loss_terms(ref + 1e-2 * bump, x)["pde"]) > float(energy)


def test_the_energy_keeps_the_contract_split_included():
    report = check_problem(SPECS["anisotropic"], options={"norm": "energy"}).assert_ok()
    assert any(r.check.startswith("split [2, 2") and r.status == "OK" for r in report.results)


def test_the_energy_refuses_a_non_symmetric_family():
    p = get_problem(SPECS["adr"], grid=(16, 16), norm="energy")
    x = p.build_input(p.sample_params(3, range(1)), torch.float64)
    with pytest.raises(ValueError, match="needs a symmetric operator.*residual_norm"):
        p.loss_terms(p.impose(torch.zeros(1, 1, 16, 16, dtype=torch.float64), x), x)
