"""A small U-Net trained for a few Adam steps, with no solution data, lowers each problem's loss.

Criterion (robust to the sign of the energies): the gap to a lower bound of the loss closes by at
least half, ``final - lb < 0.5 * (initial - lb)``, where lb is 0 for the squared residuals
(Burgers) and the exact discrete minimum (the loss of the reference finite-volume solution,
which minimises the "faces" energy) for the energy losses (Poisson, reaction-diffusion).
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from diffnet.generators import build_generator
from diffnet.problems import get_problem

GRID = (32, 32)
STEPS = 30
BATCH = 4

CASES = [
    ("burgers", {}),
    ("burgers", {"hard_bc": True}),
    ("poisson", {}),
    ("reaction_diffusion", {}),
]


def total(problem, u, x):
    return sum(t for t in problem.loss_terms(problem.impose(u, x), x).values())  # (B,)


@pytest.mark.parametrize("name,kw", CASES, ids=[f"{n}{'-hard' if k else ''}" for n, k in CASES])
def test_training_lowers_loss(name, kw):
    torch.manual_seed(0)
    problem = get_problem(name, grid=GRID, **kw)
    params = problem.sample_params(0, range(BATCH))
    x = problem.build_input(params)
    net = build_generator("unet", in_channels=len(problem.input_channels), depth=2, base_width=8)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)

    if name == "burgers":
        lower = 0.0
    else:
        ref = torch.tensor(np.stack([problem.reference_solution(p) for p in params]),
                           dtype=torch.float64)[:, None]
        lower = float(total(problem, ref, x.double()).mean())

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
