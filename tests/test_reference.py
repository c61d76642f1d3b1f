"""Classical reference solvers: exactness, convergence orders, conservation, argument checks."""
from __future__ import annotations

import numpy as np
import pytest

from diffnet.reference import solve_burgers, solve_diffusion


def _grid(h, w, ly=1.0, lx=1.0):
    return np.meshgrid(np.linspace(0, ly, h), np.linspace(0, lx, w), indexing="ij")


def _orders(errors):
    e = np.asarray(errors)
    return np.log2(e[:-1] / e[1:])


# ------------------------------------------------------------------------------------------
# Elliptic
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["direct", "amg"])
@pytest.mark.parametrize("face_mean", ["harmonic", "arithmetic"])
def test_constant_nu_is_linear_exactly(method, face_mean):
    y, x = _grid(17, 33)
    u = solve_diffusion(np.full(x.shape, 2.5), method=method, face_mean=face_mean)
    np.testing.assert_allclose(u, 1.0 - x, atol=1e-10, rtol=0)


def test_constant_nu_non_unit_lengths():
    y, x = _grid(9, 21, ly=0.5, lx=2.0)
    u = solve_diffusion(np.full(x.shape, 0.3), lengths=(0.5, 2.0))
    np.testing.assert_allclose(u, 1.0 - x / 2.0, atol=1e-10, rtol=0)


@pytest.mark.parametrize("face_mean", ["harmonic", "arithmetic"])
@pytest.mark.parametrize("nu_x", [lambda x: np.exp(np.sin(2 * np.pi * x)),
                                  lambda x: 1.0 + 0.5 * x], ids=["exp_sin", "linear"])
def test_poisson_1d_closed_form_second_order(nu_x, face_mean):
    # Closed form u(x) = 1 - I(x)/I(1), I(x) = int_0^x 1/nu, by a very fine cumulative Simpson.
    xf = np.linspace(0, 1, 2 ** 14 + 1)
    g = 1.0 / nu_x(xf)
    hf = xf[1] - xf[0]
    pair = hf / 6 * (g[:-2:2] + 4 * g[1:-1:2] + g[2::2])  # Simpson on each double interval
    cum = np.concatenate([[0.0], np.cumsum(pair)])        # at xf[::2]
    exact_fine = 1.0 - cum / cum[-1]
    errs = []
    for w in (17, 33, 65, 129):
        y, x = _grid(5, w)
        u = solve_diffusion(nu_x(x), face_mean=face_mean)
        step = (len(xf) // 2) // (w - 1)
        ex = exact_fine[::step]
        assert ex.shape == (w,)
        assert np.ptp(u, axis=0).max() < 1e-12  # y-independent
        errs.append(np.abs(u[2] - ex).max())
    orders = _orders(errs)
    assert np.all((orders > 1.7) & (orders < 2.3)), (errs, orders)


def _manufactured(n, kappa=2.0):
    y, x = _grid(n, n)
    pi = np.pi
    u = np.sin(pi * x) * np.sin(pi * y)
    nu = 1.0 + x * y
    # -div(nu grad u) = -nu lap u - grad nu . grad u,  lap u = -2 pi^2 u, grad nu = (y, x)
    ux = pi * np.cos(pi * x) * np.sin(pi * y)
    uy = pi * np.sin(pi * x) * np.cos(pi * y)
    f = 2 * pi ** 2 * nu * u - (y * ux + x * uy) + kappa ** 2 * u
    return nu, f, u


@pytest.mark.parametrize("method", ["direct", "amg"])
def test_reaction_diffusion_manufactured_second_order(method):
    errs = []
    for n in (17, 33, 65):
        nu, f, exact = _manufactured(n)
        u = solve_diffusion(nu, kappa=2.0, f=f, dirichlet="all_zero", method=method)
        assert np.all(u[[0, -1], :] == 0) and np.all(u[:, [0, -1]] == 0)
        errs.append(np.abs(u - exact).max())
    orders = _orders(errs)
    assert errs[-1] < 1e-3
    assert np.all((orders > 1.8) & (orders < 2.2)), (errs, orders)


def test_direct_and_amg_agree():
    y, x = _grid(65, 65)
    nu = np.exp(np.sin(2 * np.pi * x) * np.cos(2 * np.pi * y) + 0.5 * np.sin(6 * x * y))
    ud, infod = solve_diffusion(nu, method="direct", return_info=True)
    ua, infoa = solve_diffusion(nu, method="amg", return_info=True)
    assert infod["method"] == "direct" and infoa["method"] == "amg"
    assert infoa["residual"] < 1e-9 and infoa["iterations"] > 0
    np.testing.assert_allclose(ud, ua, atol=1e-7, rtol=0)
    # Maximum principle for the Poisson problem (an M-matrix): 0 <= u <= 1.
    assert ud.min() >= -1e-12 and ud.max() <= 1 + 1e-12
    nu2, f, _ = _manufactured(65)
    ud = solve_diffusion(nu2, kappa=2.0, f=f, dirichlet="all_zero", method="direct")
    ua = solve_diffusion(nu2, kappa=2.0, f=f, dirichlet="all_zero", method="amg")
    np.testing.assert_allclose(ud, ua, atol=1e-7, rtol=0)


def test_auto_picks_direct_on_small_grids():
    _, info = solve_diffusion(np.ones((9, 9)), return_info=True)
    assert info["method"] == "direct" and info["n_unknowns"] == 9 * 7


def test_scalar_source_and_symmetry():
    u = solve_diffusion(np.ones((21, 21)), f=1.0, dirichlet="all_zero")
    np.testing.assert_allclose(u, u.T, atol=1e-13)
    np.testing.assert_allclose(u, u[::-1], atol=1e-13)
    assert 0.07 < u[10, 10] < 0.08  # the torsion function: u(1/2, 1/2) ~ 0.0737


@pytest.mark.parametrize("kwargs, word", [
    (dict(nu=np.ones(5)), "nu"),
    (dict(nu=np.ones((2, 5))), "nu"),
    (dict(nu=-np.ones((5, 5))), "nu"),
    (dict(nu=np.full((5, 5), np.nan)), "nu"),
    (dict(nu=np.ones((5, 5)), lengths=(1.0,)), "lengths"),
    (dict(nu=np.ones((5, 5)), lengths=(1.0, 0.0)), "lengths"),
    (dict(nu=np.ones((5, 5)), kappa=-1.0), "kappa"),
    (dict(nu=np.ones((5, 5)), kappa="a"), "kappa"),
    (dict(nu=np.ones((5, 5)), f=np.ones((4, 5))), "f"),
    (dict(nu=np.ones((5, 5)), dirichlet="neumann"), "dirichlet"),
    (dict(nu=np.ones((5, 5)), method="cg"), "method"),
    (dict(nu=np.ones((5, 5)), face_mean="geometric"), "face_mean"),
    (dict(nu=np.ones((5, 5)), rtol=0.0), "rtol"),
])
def test_diffusion_bad_arguments(kwargs, word):
    nu = kwargs.pop("nu")
    with pytest.raises(ValueError, match=word):
        solve_diffusion(nu, **kwargs)


# ------------------------------------------------------------------------------------------
# Burgers
# ------------------------------------------------------------------------------------------
def _u0(c):
    return lambda x: 0.5 * (1.0 - np.cos(2 * np.pi * c * x))


def _characteristics(c, x, t, iters=200):
    """u(x, t) = u0(x0) with x = x0 + u0(x0) t, x0 by bisection (monotone map before the shock)."""
    u0 = _u0(c)
    lo, hi = np.zeros_like(x), np.ones_like(x)
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        right = mid + u0(mid) * t > x
        hi = np.where(right, mid, hi)
        lo = np.where(right, lo, mid)
    return u0(0.5 * (lo + hi))


def test_burgers_initial_row_exact_and_shape():
    u0 = _u0(3)
    u = solve_burgers(u0, x_nodes=33, t_nodes=17)
    assert u.shape == (17, 33) and u.dtype == np.float64
    np.testing.assert_array_equal(u[0], u0(np.linspace(0, 1, 33)))
    assert np.all(u[:, 0] == 0.0)  # inflow value


def test_burgers_pre_shock_follows_characteristics():
    c = 3
    t_shock = 1.0 / (np.pi * c)  # 1 / max(-u0'), u0' = pi c sin(2 pi c x)
    t_end = 0.02
    assert t_end < 0.5 * t_shock
    x = np.linspace(0, 1, 65)
    t = np.linspace(0, t_end, 9)
    exact = np.stack([_characteristics(c, x, tk) for tk in t])
    errs = []
    for refine in (2, 4, 8, 16):
        u = solve_burgers(_u0(c), x_nodes=65, t_nodes=9, t_end=t_end, refine=refine)
        errs.append(np.abs(u - exact).max())
    orders = _orders(errs)
    assert errs[-1] < 2e-3, errs
    assert np.all(np.diff(errs) < 0), errs
    assert np.all(orders > 0.8), (errs, orders)  # first-order scheme


def _nodal_balance_error(u, t):
    """max_k |M(t_k) - M(0) + int_0^t_k u(1,t)^2/2 dt| from the node output (trapezoid in x, t)."""
    x = np.linspace(0, 1, u.shape[1])
    mass = np.trapezoid(u, x, axis=1)
    out = np.concatenate([[0.0], np.cumsum(0.25 * np.diff(t) * (u[1:, -1] ** 2 + u[:-1, -1] ** 2))])
    return np.abs(mass - mass[0] + out).max()


@pytest.mark.parametrize("c", [3, 5, 8])
def test_burgers_post_shock_conservation_and_max_principle(c):
    u0 = _u0(c)
    n = 129
    u, info = solve_burgers(u0, x_nodes=n, t_nodes=n, return_info=True)
    # the shocks must have formed (O(1) jumps between neighbouring nodes)
    assert np.abs(np.diff(u[-1])).max() > 0.2
    # discrete mass balance of the finite-volume scheme (exact up to round-off)
    m, fin, fout = info["mass"], info["inflow"], info["outflow"]
    np.testing.assert_allclose(m - m[0], fin - fout, atol=1e-13, rtol=0)
    assert np.all(fin == 0.0)  # u >= 0: nothing enters through x = 0
    assert fout[-1] > 0.01
    # the same balance from the node output (trapezoid in x and t): O(h) through the shocks
    err = _nodal_balance_error(u, info["t"])
    u_half = solve_burgers(u0, x_nodes=65, t_nodes=65)
    err_half = _nodal_balance_error(u_half, np.linspace(0, 1 / 3, 65))
    assert err < 3.0 / (n - 1) and err < 0.6 * err_half, (err, err_half)
    # maximum principle: stays in [min u0, max u0]
    assert u.min() >= 0.0 - 1e-14 and u.max() <= 1.0 + 1e-14
    assert info["cells"].min() >= -1e-14 and info["cells"].max() <= 1 + 1e-14
    # total variation of the cell averages does not increase
    tv = np.abs(np.diff(info["cells"], axis=1)).sum(axis=1)
    assert np.all(np.diff(tv) <= 1e-12)


def test_burgers_l1_convergence_after_shock():
    c = 5
    x_nodes, fine_refine = 33, 128
    _, ref = solve_burgers(_u0(c), x_nodes=x_nodes, t_nodes=2, refine=fine_refine,
                           return_info=True)
    ref_cells = ref["cells"][-1]
    errs = []
    for refine in (2, 4, 8, 16):
        _, info = solve_burgers(_u0(c), x_nodes=x_nodes, t_nodes=2, refine=refine,
                                return_info=True)
        coarse = info["cells"][-1]
        block = ref_cells.reshape(coarse.size, -1).mean(axis=1)  # fine averages -> coarse cells
        errs.append(info["dx"] * np.abs(coarse - block).sum())
    orders = _orders(errs)
    assert np.all(orders > 0.7), (errs, orders)
    # the node output converges too (sampled against the fine run)
    u_ref = solve_burgers(_u0(c), x_nodes=x_nodes, t_nodes=2, refine=fine_refine)
    u_16 = solve_burgers(_u0(c), x_nodes=x_nodes, t_nodes=2, refine=16)
    assert np.abs(u_16[-1] - u_ref[-1]).mean() < 0.05


def test_burgers_riemann_problems_sign_changing():
    """Entropy solutions with u of both signs: transonic rarefaction and a moving shock."""
    x = np.linspace(0, 1, 129)
    t = 0.4
    # transonic rarefaction (the Godunov flux must not produce an expansion shock)
    u = solve_burgers(lambda s: np.where(s < 0.5, -0.5, 0.5), x_nodes=129, t_nodes=2, t_end=t)
    exact = np.clip((x - 0.5) / t, -0.5, 0.5)
    assert np.abs(u[-1] - exact).mean() < 5e-3
    assert u.min() >= -0.5 - 1e-14 and u.max() <= 0.5 + 1e-14
    # shock between 0.8 and -0.4 moving at speed 0.2, plus a rarefaction 0 -> 0.8 at the inflow
    u = solve_burgers(lambda s: np.where(s < 0.5, 0.8, -0.4), x_nodes=129, t_nodes=2, t_end=t)
    exact = np.where(x < 0.5 + 0.2 * t, np.minimum(x / t, 0.8), -0.4)
    assert np.abs(u[-1] - exact).mean() < 5e-3
    assert u[-1, 0] == 0.0 and u.min() >= -0.4 - 1e-14 and u.max() <= 0.8 + 1e-14


def test_burgers_timing_64():
    import time
    t0 = time.perf_counter()
    solve_burgers(_u0(5), x_nodes=64, t_nodes=64)
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("kwargs, word", [
    (dict(u0=np.zeros(5)), "u0"),
    (dict(u0=lambda x: x[:2]), "u0"),
    (dict(u0=lambda x: np.full_like(x, np.inf)), "u0"),
    (dict(x_nodes=1), "x_nodes"),
    (dict(x_nodes=4.5), "x_nodes"),
    (dict(t_nodes=1), "t_nodes"),
    (dict(t_end=0.0), "t_end"),
    (dict(t_end=float("nan")), "t_end"),
    (dict(refine=0), "refine"),
    (dict(cfl=1.5), "cfl"),
    (dict(cfl=0.0), "cfl"),
])
def test_burgers_bad_arguments(kwargs, word):
    args = dict(u0=_u0(3), x_nodes=9, t_nodes=9)
    args.update(kwargs)
    u0 = args.pop("u0")
    with pytest.raises(ValueError, match=word):
        solve_burgers(u0, **args)
