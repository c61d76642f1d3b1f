"""The 3-D reference solver (vertex-centred finite volumes, 7-point, harmonic faces): exact where
the scheme is exact (constant nu; nu(x) with 1/nu linear between nodes), second order against
the closed form of nu(x) and on a manufactured solution with the Poisson boundary conditions,
direct and AMG agreeing, the maximum principle, argument checks. Tiny grids (<= 33^3)."""
from __future__ import annotations

import numpy as np
import pytest

from diffnet.reference import DIRECT_MAX_UNKNOWNS, assemble_diffusion, solve_diffusion

PI = np.pi


def box(d, h, w, lengths=(1.0, 1.0, 1.0)):
    """Node coordinates z, y, x, each (D, H, W)."""
    return np.meshgrid(*(np.linspace(0, length, n) for length, n in zip(lengths, (d, h, w))),
                       indexing="ij")


def orders(errors):
    e = np.asarray(errors)
    return np.log2(e[:-1] / e[1:])


# -- exact where the scheme is exact ------------------------------------------------------------
@pytest.mark.parametrize("method", ["direct", "amg"])
@pytest.mark.parametrize("face_mean", ["harmonic", "arithmetic"])
def test_constant_nu_gives_the_linear_solution(method, face_mean):
    """Constant nu: u = 1 - x / Lx solves the scheme exactly (to the solver's tolerance: direct
    rounding; AMG relative residual 1e-10 -> 1e-9 nodal)."""
    z, y, x = box(5, 7, 9, lengths=(0.5, 2.0, 1.5))
    u = solve_diffusion(np.full(x.shape, 0.3), lengths=(0.5, 2.0, 1.5), method=method,
                           face_mean=face_mean)
    tol = 1e-12 if method == "direct" else 1e-9
    np.testing.assert_allclose(u, 1.0 - x / 1.5, atol=tol, rtol=0)


def closed_form(inv_nu, x):
    """u(x) = 1 - I(x) / I(1), I(x) = int_0^x 1/nu, by a very fine composite Simpson rule."""
    xf = np.linspace(0, 1, 2 ** 14 + 1)
    g = inv_nu(xf)
    pair = (xf[1] - xf[0]) / 6 * (g[:-2:2] + 4 * g[1:-1:2] + g[2::2])  # per double interval
    cum = np.concatenate([[0.0], np.cumsum(pair)])                    # at xf[::2]
    return np.interp(x, xf[::2], 1.0 - cum / cum[-1])


@pytest.mark.parametrize("inv_nu", [lambda x: 1.0 + 3.0 * x,
                                    lambda x: 1.0 + 8.0 * np.abs(x - 0.5)],
                         ids=["linear", "kink_at_a_node"])
def test_nu_of_x_with_1_over_nu_linear_between_nodes_is_exact(inv_nu):
    """The harmonic face value makes h / nu_face the trapezoid rule of int 1/nu over a cell,
    exact when 1/nu is linear between neighbouring nodes (a kink at a node included), so the
    closed form u(x) = 1 - int_0^x 1/nu / int_0^1 1/nu is reproduced to rounding (1e-12; the
    closed form itself is the trapezoid sum here, exact for piecewise-linear 1/nu), and u
    depends on x alone."""
    z, y, x = box(4, 5, 17)
    u = solve_diffusion(1.0 / inv_nu(x), method="direct")
    xs = x[0, 0]
    g = inv_nu(xs)
    cum = np.concatenate([[0.0], np.cumsum(0.5 * (g[1:] + g[:-1]) * np.diff(xs))])
    np.testing.assert_allclose(u, np.broadcast_to(1.0 - cum / cum[-1], u.shape), atol=1e-12,
                               rtol=0)
    # and the trapezoid sum is the exact integral: the closed form itself
    np.testing.assert_allclose(u[0, 0], closed_form(inv_nu, xs), atol=1e-12, rtol=0)


@pytest.mark.parametrize("face_mean", ["harmonic", "arithmetic"])
def test_smooth_nu_of_x_against_the_closed_form_second_order(face_mean):
    """nu = exp(sin 2 pi x): u is y- and z-independent to rounding and converges to the closed
    form at second order (observed order in [1.8, 2.2] over W = 9 .. 65; 2-D's bound)."""
    nu_x = lambda x: np.exp(np.sin(2 * PI * x))  # noqa: E731
    errs = []
    for w in (9, 17, 33, 65):
        z, y, x = box(4, 4, w)
        u = solve_diffusion(nu_x(x), face_mean=face_mean, method="direct")
        assert np.ptp(u, axis=(0, 1)).max() < 1e-12
        errs.append(np.abs(u[1, 2] - closed_form(lambda t: 1.0 / nu_x(t), x[0, 0])).max())
    got = orders(errs)
    assert np.all((got > 1.8) & (got < 2.2)), (errs, got)


# -- second order on a manufactured solution with the Poisson boundary conditions -----------------
def manufactured(n, a=0.5):
    """u = 1 - x + a sin(pi x) cos(pi y) cos(pi z): u = 1 at x = 0, 0 at x = 1, du/dn = 0 on the
    y and z faces; nu = 1 + x y + z^2 / 2; f = -div(nu grad u)."""
    z, y, x = box(n, n, n)
    s, cy, cz = np.sin(PI * x), np.cos(PI * y), np.cos(PI * z)
    u = 1 - x + a * s * cy * cz
    ux = -1 + a * PI * np.cos(PI * x) * cy * cz
    uy = -a * PI * s * np.sin(PI * y) * cz
    uz = -a * PI * s * cy * np.sin(PI * z)
    nu = 1 + x * y + 0.5 * z ** 2
    f = -(nu * (-3 * PI ** 2 * a * s * cy * cz) + y * ux + x * uy + z * uz)
    return nu, f, u


def test_manufactured_solution_second_order_with_neumann_half_cells():
    """Max nodal error over 9^3, 17^3, 33^3 (auto: direct, then AMG): observed order in
    [1.8, 2.2] (measured 1.995, 1.999); the Neumann faces' half cells keep second order."""
    errs = []
    for n in (9, 17, 33):
        nu, f, exact = manufactured(n)
        u = solve_diffusion(nu, f=f)
        assert np.all(u[..., 0] == 1) and np.all(u[..., -1] == 0)
        errs.append(np.abs(u - exact).max())
    got = orders(errs)
    assert errs[-1] < 1e-3
    assert np.all((got > 1.8) & (got < 2.2)), (errs, got)


def test_all_zero_torsion_symmetric_and_near_the_known_value():
    """-lap u = 1, u = 0 on the unit cube: symmetric under every axis reflection and axis swap,
    centre value 0.05588 at 17^3 (0.05613 at 33^3) -> 0.0562 (the cube's torsion maximum)."""
    u = solve_diffusion(np.ones((17, 17, 17)), f=1.0, dirichlet="all_zero", method="direct")
    for v in (u[::-1], u[:, ::-1], u[..., ::-1], u.transpose(1, 0, 2), u.transpose(2, 1, 0)):
        np.testing.assert_allclose(v, u, atol=1e-14, rtol=0)
    assert 0.0555 < u[8, 8, 8] < 0.0565
    assert np.all(u[[0, -1]] == 0) and np.all(u[:, [0, -1]] == 0) and np.all(u[..., [0, -1]] == 0)


# -- solvers ---------------------------------------------------------------------------------------
def kl_nu(n):
    z, y, x = box(n, n, n)
    return np.exp(2 * np.cos(PI * x) * np.cos(PI * y) + 1.5 * np.cos(PI * z))  # contrast ~1100


def test_direct_and_amg_agree_and_the_maximum_principle_holds():
    nu = kl_nu(17)
    ud, infod = solve_diffusion(nu, method="direct", return_info=True)
    ua, infoa = solve_diffusion(nu, method="amg", return_info=True)
    assert infod["method"] == "direct" and infoa["method"] == "amg"
    assert infoa["residual"] < 1e-9 and infoa["iterations"] > 0
    np.testing.assert_allclose(ua, ud, atol=1e-8, rtol=0)
    assert ud.min() >= -1e-12 and ud.max() <= 1 + 1e-12       # an M-matrix


def test_auto_switches_to_amg_above_the_threshold():
    _, small = solve_diffusion(kl_nu(9), return_info=True)
    assert small["method"] == "direct" and small["n_unknowns"] == 9 * 9 * 7
    _, large = solve_diffusion(kl_nu(17), return_info=True)
    assert large["n_unknowns"] == 17 * 17 * 15 > DIRECT_MAX_UNKNOWNS[3]
    assert large["method"] == "amg"


def test_matrix_is_symmetric_and_conservative():
    """Symmetric; with no Dirichlet elimination the rows would sum to zero, so here the row sums
    are exactly the conductances to the eliminated Dirichlet faces (b = row-sum at x = 0)."""
    a, b, free, u_full = assemble_diffusion(kl_nu(6))
    assert abs(a - a.T).max() < 1e-12 * abs(a).max()
    rows = np.asarray(a.sum(axis=1)).ravel()
    free_x = np.argwhere(free)[:, 2]
    np.testing.assert_allclose(rows[(free_x > 1) & (free_x < 4)], 0.0, atol=1e-12)
    np.testing.assert_allclose(b[free_x == 1], rows[free_x == 1], rtol=1e-12)


def test_a_field_constant_along_z_solves_like_its_2d_slice():
    """One assembly for 2-D and 3-D: with nu and f constant along z and zero flux through the
    z-faces, every z-slice of the 3-D solution is the 2-D solution of the slice (to rounding),
    whatever the box's depth."""
    rng = np.random.default_rng(5)
    nu2 = np.exp(rng.normal(size=(7, 9)))
    f2 = rng.normal(size=(7, 9))
    u2 = solve_diffusion(nu2, f=f2, lengths=(0.8, 1.2))
    nu3, f3 = (np.broadcast_to(a, (5, 7, 9)) for a in (nu2, f2))
    u3 = solve_diffusion(nu3, f=f3, lengths=(0.5, 0.8, 1.2))
    np.testing.assert_allclose(u3, np.broadcast_to(u2, u3.shape), rtol=0, atol=1e-13)


@pytest.mark.parametrize("kwargs, word", [
    (dict(nu=np.ones((5, 5, 5, 5))), "nu"),
    (dict(nu=np.ones((2, 5, 5))), "nu"),
    (dict(nu=-np.ones((5, 5, 5))), "nu"),
    (dict(nu=np.full((5, 5, 5), np.nan)), "nu"),
    (dict(nu=np.ones((5, 5, 5)), lengths=(1.0, 1.0)), "lengths"),
    (dict(nu=np.ones((5, 5, 5)), lengths=(1.0, 0.0, 1.0)), "lengths"),
    (dict(nu=np.ones((5, 5, 5)), kappa=-1.0), "kappa"),
    (dict(nu=np.ones((5, 5, 5)), f=np.ones((5, 5))), "f"),
    (dict(nu=np.ones((5, 5, 5)), dirichlet="neumann"), "dirichlet"),
    (dict(nu=np.ones((5, 5, 5)), method="cg"), "method"),
    (dict(nu=np.ones((5, 5, 5)), face_mean="geometric"), "face_mean"),
    (dict(nu=np.ones((5, 5, 5)), rtol=0.0), "rtol"),
])
def test_bad_arguments_name_the_argument(kwargs, word):
    nu = kwargs.pop("nu")
    with pytest.raises(ValueError, match=word):
        solve_diffusion(nu, **kwargs)
