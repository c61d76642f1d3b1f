"""The answer residual every problem has from its loss (diffnet.problems.contract.loss_residual):
0 at the discrete solution for a residual-form plugin, an energy-form built-in and a Ritz head,
1 at the lift, growing with the error; non-finite answers read NaN alone; the caller's problem
is left as it was."""
import os
import sys

import numpy as np
import pytest
import torch

from diffnet.problems import get_problem, loss_residual, residual_kind
from tests.mpi_util import ROOT

FAMILIES = os.path.join(ROOT, "examples", "families")
if FAMILIES not in sys.path:
    sys.path.insert(0, FAMILIES)      # what PYTHONPATH=examples/families does

CASES = {
    "adr (squared residual)": ("adr:ADR", {}),
    "adr (multilevel norm)": ("adr:ADR", {"norm": "multilevel"}),
    "poisson energy, lift": ("poisson", {"loss": "energy", "bc_mode": "lift"}),
    "poisson energy, overwrite": ("poisson", {"loss": "energy"}),
    "darcy, Ritz head": ("darcy", {"ritz": True, "ritz_fields": 2}),
    "poisson3d energy": ("poisson3d", {"grid": (9, 9, 9)}),
}


def case(label):
    name, options = CASES[label]
    p = get_problem(name, **{"grid": (17, 17), **options})
    params = p.sample_params(4, range(3))
    x = p.build_input(params, dtype=torch.float64)
    ref = np.stack([p.reference_solution(q) for q in params])
    lift = p.impose(torch.zeros(3, p.output_channels, *p.grid, dtype=torch.float64), x)[:, :1]
    return p, x, ref, lift


@pytest.mark.parametrize("label", CASES)
def test_zero_at_the_solution_one_at_the_lift_growing_with_the_error(label):
    p, x, ref, lift = case(label)
    at_ref = loss_residual(p, ref, x)
    assert at_ref.shape == (3,) and at_ref.dtype == np.float64
    assert np.all(at_ref < 1e-9), at_ref
    np.testing.assert_allclose(loss_residual(p, lift, torch.from_numpy(x.numpy())), 1.0,
                               rtol=1e-12)
    # a smooth error that vanishes on every wall, of 2% and of 10% of the solution's size
    shape = np.ones(p.grid)
    for axis, n in enumerate(p.grid):
        s = np.sin(np.pi * np.linspace(0, 1, n))
        shape = shape * s.reshape([-1 if a == axis else 1 for a in range(len(p.grid))])
    size = np.abs(ref).max(axis=tuple(range(1, ref.ndim)), keepdims=True)
    small, large = (loss_residual(p, ref + a * size * shape, x) for a in (0.02, 0.1))
    assert np.all(small > 1e-4) and np.all(large > 4 * small), (small, large)


def test_the_family_own_residual_wins_and_the_plugins_is_the_loss():
    adr, darcy = get_problem("adr:ADR", grid=(17, 17)), get_problem("darcy", grid=(17, 17))
    assert residual_kind(adr) == "loss" and residual_kind(darcy) == "family"
    x = adr.build_input(adr.sample_params(0, range(2)), dtype=torch.float64)
    u = torch.rand(2, 1, 17, 17, dtype=torch.float64)
    np.testing.assert_array_equal(adr.answer_residual(u, x), loss_residual(adr, u, x))


def test_a_non_finite_answer_reads_nan_alone_and_the_callers_problem_is_untouched():
    """The residual runs under inference mode too (infer's), on a copy of the problem at the
    end of its loss's schedule: the caller's problem keeps its progress."""
    p = get_problem("burgers", grid=(17, 17), smoothing=0.1, scheme="lax-oleinik")
    p.set_progress(0.25)
    x = p.build_input(p.sample_params(0, range(3)), dtype=torch.float64)
    u = torch.rand(3, 1, 17, 17, dtype=torch.float64)
    alone = loss_residual(p, u[1:], x[1:])
    u[0, 0, 3, 3] = float("nan")
    with torch.inference_mode():
        got = loss_residual(p, u, x)
    assert np.isnan(got[0]) and np.all(np.isfinite(got[1:]))
    np.testing.assert_allclose(got[1:], alone, rtol=1e-12)
    assert p.progress == 0.25
