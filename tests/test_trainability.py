"""A small U-Net trained for a few Adam steps, with no solution data, lowers each problem's loss.

Every registered 2-D problem with its default options is trained (never a fixed list of names),
and a few named option sets of the problems that have them.

Criterion (robust to the sign of the energies): the gap to a lower bound of the loss closes by at
least half, ``final - lb < 0.5 * (initial - lb)``, where lb = min(0, the loss of the reference
solution) bounds every loss here from below: squared residuals and source-free energies are >= 0,
and an energy with a source is bounded by its discrete minimum, the loss of the reference
finite-volume solution (which minimises the "faces" energy). Without a reference solver, lb = 0.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from diffnet.generators import build_generator
from diffnet.problems import PROBLEMS, get_problem, has_reference

GRID = (32, 32)
STEPS = 30
BATCH = 4

EXTRA = [("burgers", {"hard_bc": True})]   # option sets worth their own case, if registered
CASES = [(n, {}) for n in sorted(PROBLEMS) if PROBLEMS[n].dims == 2] + [
    (n, kw) for n, kw in EXTRA if n in PROBLEMS]
FULL = {"poisson", "reaction_diffusion"}  # the slowest cases: `make test-full` trains them


def params():
    return [pytest.param(n, kw, id=f"{n}{'-hard' if kw else ''}",
                         marks=[pytest.mark.full] if n in FULL and not kw else [])
            for n, kw in CASES]


def total(problem, u, x):
    return sum(t for t in problem.loss_terms(problem.impose(u, x), x).values())  # (B,)


@pytest.mark.parametrize("name,kw", params())
def test_training_lowers_loss(name, kw):
    torch.manual_seed(0)
    problem = get_problem(name, grid=GRID, **kw)
    params = problem.sample_params(0, range(BATCH))
    x = problem.build_input(params)
    net = build_generator("unet", in_channels=len(problem.input_channels), depth=2, base_width=8)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)

    lower = 0.0
    if has_reference(problem):
        ref = torch.tensor(np.stack([problem.reference_solution(p) for p in params]),
                           dtype=torch.float64)[:, None]
        lower = min(0.0, float(total(problem, ref, x.double()).mean()))

    t0 = time.perf_counter()
    history = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = total(problem, net(x), x).mean()
        loss.backward()
        opt.step()
        history.append(loss.item())
    with torch.no_grad():
        final = float(total(problem, net(x), x).mean())
    elapsed = time.perf_counter() - t0
    initial = history[0]
    assert np.isfinite(final)
    print(name, kw, initial, final, lower)
    assert final - lower < 0.5 * (initial - lower), (name, initial, final, lower, elapsed)
