"""The exact Burgers entropy solution (Lax-Oleinik) against characteristics, an exact Riemann
solution and the independent Godunov solver under refinement; its fast lower-hull search
(the default) against the brute-force search, and the hull itself against Andrew's monotone
chain."""
from __future__ import annotations

import numpy as np
import pytest

from diffnet.reference import solve_burgers, solve_burgers_exact
from diffnet.reference import burgers_exact
from diffnet.reference.burgers_exact import _fine_argmin, _lower_hull, _primitive


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


# --- the lower-hull search (method="hull", the default) against the brute force --------------

def _random_u0(seed):
    """A smooth positive u0: five random Fourier modes (amplitude ~ 1 / m) over a constant that
    keeps it > 0, scaled to max <= 1."""
    rng = np.random.default_rng(seed)
    m = np.arange(1, 6)
    a, b = rng.normal(size=(2, 5)) / m
    a0 = np.abs(a).sum() + np.abs(b).sum() + 0.05
    return lambda x: (a0 + np.cos(2 * np.pi * np.multiply.outer(x, m)) @ a
                      + np.sin(2 * np.pi * np.multiply.outer(x, m)) @ b) / (2 * a0)


_U0S = {"c3": _u0(3), "c4.7": _u0(4.7), "c6": _u0(6), "c16": _u0(16), "random": _random_u0(0)}


def _check_hull_against_brute(u0, nx, nt, t_end=1 / 3, oversample=64, max_tie_frac=0.005):
    """hull == brute force to 1e-12 except at nodes where the two fine-grid minima of G tie
    within round-off (a shock through the node): rare, and there both results are one-sided
    states. Returns the number of tie nodes."""
    hull = solve_burgers_exact(u0, x_nodes=nx, t_nodes=nt, t_end=t_end, oversample=oversample)
    brute = solve_burgers_exact(u0, x_nodes=nx, t_nodes=nt, t_end=t_end, oversample=oversample,
                                method="brute")
    assert hull.dtype == brute.dtype == np.float64
    tie = np.abs(hull - brute) > 1e-12
    assert tie.sum() <= max_tie_frac * tie.size, tie.sum()
    x, t = np.linspace(0, 1, nx), np.linspace(0, t_end, nt)
    y, big_u0 = _primitive(u0, oversample * (nx - 1))
    k_hull = _fine_argmin(x, t, y, big_u0, oversample, "hull", clip=False)
    k_brute = _fine_argmin(x, t, y, big_u0, oversample, "brute")
    # the unconstrained hull minimiser respects the brute force's y <= x by itself (u0 >= 0)
    assert np.all(k_hull[1:] <= oversample * np.arange(nx))
    n, j = np.nonzero(tie)
    g = lambda k: big_u0[k] + (x[j] - y[k]) ** 2 / (2 * t[n])   # G as the brute force has it
    g_hull, g_brute = g(k_hull[n, j]), g(k_brute[n, j])
    np.testing.assert_array_less(np.abs(g_hull - g_brute), 4 * np.finfo(float).eps * g_brute)
    assert np.all(np.abs(k_hull[n, j] - k_brute[n, j]) > 1)     # two distant feet: a shock
    for u in (hull, brute):                                     # each the state of a foot
        np.testing.assert_allclose(u[n, j], u0(x[j] - u[n, j] * t[n]), rtol=0, atol=1e-12)
    assert np.all(np.abs(hull[n, j] - brute[n, j]) > 1e-2)      # a jump, not round-off
    return int(tie.sum())


@pytest.mark.parametrize("grid", [(65, 33), (129, 65)])
@pytest.mark.parametrize("name", list(_U0S))
def test_hull_equals_brute_force_except_at_round_off_ties(name, grid):
    ties = _check_hull_against_brute(_U0S[name], *grid)
    if name == "c16" and grid == (65, 33):
        # shocks at x = (i + 3/4) / 16 + t / 2 land exactly on nodes here: the ties do occur
        assert ties > 0


@pytest.mark.parametrize("name", ["c6", "random"])
def test_hull_at_small_times_and_in_one_big_step(name):
    # 1024 rows: row 1 at t = 3e-4, where y^2 / (2 t) would swamp U0 if it were formed
    _check_hull_against_brute(_U0S[name], 33, 1025)
    # one step to t_end: the first hull is pruned from every fine point at once (bulk passes
    # and the sequential work list), with all shocks already formed
    _check_hull_against_brute(_U0S[name], 129, 2)


def test_hull_of_a_step_with_a_fan_and_a_shock():
    u0 = lambda x: np.where((x > 0.1) & (x <= 0.3), 1.0, 0.0)
    _check_hull_against_brute(u0, 101, 21, t_end=0.6, oversample=16)


def _monotone_chain(px, py):
    """Andrew's monotone chain, lower half (reference): indices of the strict hull vertices."""
    hull = []
    for i in range(px.size):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            if (px[b] - px[a]) * (py[i] - py[a]) - (py[b] - py[a]) * (px[i] - px[a]) > 0:
                break
            hull.pop()
        hull.append(i)
    return np.array(hull)


@pytest.mark.parametrize("bulk", [0, 256, 10 ** 9])    # work list only, mixed, passes only
@pytest.mark.parametrize("seed", range(3))
def test_lower_hull_matches_monotone_chain(seed, bulk, monkeypatch):
    monkeypatch.setattr(burgers_exact, "_BULK", bulk)
    rng = np.random.default_rng(seed)
    k = np.sort(rng.choice(20000, size=4000, replace=False))
    uk = np.cumsum(rng.normal(size=k.size)) + 30 * np.sin(k / 700.0)
    h2t = 10.0 ** rng.uniform(-6, -3)
    hull_k, hull_u = _lower_hull(k, uk, h2t)
    ref = _monotone_chain(k.astype(float), uk + h2t * k.astype(float) ** 2)
    assert 2 < ref.size < k.size // 2
    np.testing.assert_array_equal(hull_k, k[ref])
    np.testing.assert_array_equal(hull_u, uk[ref])


def test_method_is_checked():
    with pytest.raises(ValueError, match="method"):
        solve_burgers_exact(_u0(3), x_nodes=16, t_nodes=4, method="qhull")


# --- the exact cell averages (what a perfect finite-volume solution holds) -------------------
def test_cell_averages_of_a_shock_and_a_fan_are_exact():
    """u0 = 1 on (0.1, 0.3] at t = 0.2: a fan on [0.1, 0.3], 1 on (0.3, 0.4), the shock at 0.4
    (on node 40, whose cell holds half of each state). The closed form's integral F gives
    every cell's average as a difference of F."""
    u0 = lambda x: np.where((x > 0.1) & (x <= 0.3), 1.0, 0.0)
    avg = burgers_exact.exact_cell_averages(u0, x_nodes=101, t_nodes=2, t_end=0.2,
                                            oversample=256)

    def big_f(x):  # int_0^x u(s, 0.2) ds
        fan = np.clip(x, 0.1, 0.3)
        return (fan - 0.1) ** 2 / 0.4 + np.clip(np.minimum(x, 0.4) - 0.3, 0.0, None)

    x = np.linspace(0.0, 1.0, 101)
    faces = np.concatenate([[0.0], x[:-1] + 0.005, [1.0]])
    np.testing.assert_allclose(avg[-1], np.diff(big_f(faces)) / np.diff(faces), atol=1e-10)
    assert avg[-1, 40] == pytest.approx(0.5, abs=1e-10)
    np.testing.assert_allclose(avg[0], np.diff(np.clip(faces, 0.1, 0.3)) / np.diff(faces),
                               atol=1e-10)                    # row 0: the averages of u0


def test_cell_averages_are_second_order_before_shocks_and_half_order_after():
    """Average minus nodal value is dx^2 u_xx / 24 on a smooth solution (the distance falls 4x
    per halving of dx) and O(sqrt(dx)) in L2 once shocks exist (a shock cell is off by about
    half the jump): the rate a conservative method's answer approaches the nodal one."""
    def dist(c, n, t_end):
        args = dict(x_nodes=n, t_nodes=17, t_end=t_end)
        avg = burgers_exact.exact_cell_averages(_u0(c), **args)
        return _rel(avg, solve_burgers_exact(_u0(c), **args))

    smooth = [dist(3.0, n, 0.05) for n in (33, 65, 129)]        # breaking at t = 0.106
    assert 3.7 < smooth[0] / smooth[1] < 4.3 and 3.7 < smooth[1] / smooth[2] < 4.3, smooth
    shocks = [dist(4.3, n, 1 / 3) for n in (129, 513)]
    assert 1.6 < shocks[0] / shocks[1] < 2.6, shocks                  # sqrt(4) = 2
