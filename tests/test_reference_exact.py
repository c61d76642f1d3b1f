"""The exact Burgers entropy solution (Lax-Oleinik) against characteristics, an exact Riemann
solution and the independent Godunov solver under refinement."""
from __future__ import annotations

import numpy as np
import pytest

from diffnet.reference import solve_burgers, solve_burgers_exact


def _u0(c):
    return lambda x: 0.5 * (1.0 - np.cos(2.0 * np.pi * c * x))


def _rel(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_pre_shock_is_the_characteristic_solution_to_round_off():
    c, t_end = 3.0, 0.05                       # breaking time 1 / (pi c) = 0.106
    u = solve_burgers_exact(_u0(c), x_nodes=65, t_nodes=6, t_end=t_end)
    x, t = np.linspace(0, 1, 65), np.linspace(0, t_end, 6)
    np.testing.assert_allclose(u[0], _u0(c)(x), atol=1e-15)
    # off shocks u is the value carried from the foot: u = u0(x - u t)
    np.testing.assert_allclose(u, _u0(c)(x[None] - u * t[:, None]), atol=1e-12)


def test_single_shock_moves_at_the_rankine_hugoniot_speed():
    # u0 = 1 on (0.1, 0.3], 0 elsewhere: a rarefaction from x = 0.1 and a shock from x = 0.3
    # at speed 1/2 until the fan catches it (t = 0.4); at t = 0.2 the shock sits at x = 0.4.
    u0 = lambda x: np.where((x > 0.1) & (x <= 0.3), 1.0, 0.0)
    u = solve_burgers_exact(u0, x_nodes=101, t_nodes=2, t_end=0.2, oversample=256)[-1]
    x = np.linspace(0, 1, 101)
    fan = np.clip((x - 0.1) / 0.2, 0.0, 1.0)
    exact = np.where(x < 0.4, fan, 0.0)
    away = np.abs(x - 0.4) > 0.011             # the node on the shock may take either state
    np.testing.assert_allclose(u[away], exact[away], atol=2e-3)


@pytest.mark.parametrize("c", [3.37, 5.41])
def test_godunov_converges_to_it_after_shocks(c):
    exact = solve_burgers_exact(_u0(c), x_nodes=64, t_nodes=64)
    assert np.abs(np.diff(exact[-1])).max() > 0.3          # sharp shocks have formed
    errs = [_rel(solve_burgers(_u0(c), x_nodes=64, t_nodes=64, refine=r), exact)
            for r in (8, 32, 128)]
    assert errs[0] > errs[1] > errs[2] and errs[2] < min(0.035, 0.5 * errs[0]), errs


def test_rejects_negative_initial_values():
    with pytest.raises(ValueError, match="u0 must be >= 0"):
        solve_burgers_exact(lambda x: np.sin(2 * np.pi * x), x_nodes=16, t_nodes=4)
    with pytest.raises(ValueError, match="x_nodes"):
        solve_burgers_exact(_u0(3), x_nodes=1, t_nodes=4)
