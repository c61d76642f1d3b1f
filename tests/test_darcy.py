"""The Darcy family (issue #19): the spectral random field (FNO convention, any grid, nested
truncations), the options and presets, the thresholded coefficient at the nodes, the reference
solver against a layered medium in closed form and under refinement, the energy's minimiser,
and a coefficient array through ``deepfusion infer --inputs`` -- all in float64."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy.fft import idctn

from diffnet.problems import get_problem
from diffnet.problems.families.diffusion import trapezoid_weights
from diffnet.problems.contract.ritz import gram
from diffnet.problems.families.random_fields import (cosine_basis, draw_coefficients, grf_scales,
                                            render, xi_stream_positions)
from diffnet.reference import solve_diffusion


def make(grid=(16, 16), **kw):
    return get_problem("darcy", grid=grid, **kw)


def rel_l2(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# -- the random field -----------------------------------------------------------------------------
def test_scaling_is_the_fno_generators():
    """GRF.m: U = idct2(s * coef .* xi) with coef = tau^(alpha-1) (pi^2 |k|^2 + tau^2)^(-alpha/2)
    and L(1,1) = 0 is our series with s modes evaluated at the cell centres (n + 1/2) / s."""
    s, tau, alpha = 12, 3.0, 2.0
    xi = np.random.default_rng(0).standard_normal((s, s))
    k1, k2 = np.meshgrid(np.arange(s), np.arange(s), indexing="ij")
    coef = tau ** (alpha - 1) * (np.pi ** 2 * (k1 ** 2 + k2 ** 2) + tau ** 2) ** (-alpha / 2)
    big_l = s * coef * xi
    big_l[0, 0] = 0.0
    fno = idctn(big_l, type=2, norm="ortho")                  # Matlab's idct2
    t = (np.arange(s) + 0.5) / s
    ours = render((grf_scales(s, tau, alpha) * xi).reshape(1, -1), t, t)[0]
    np.testing.assert_allclose(ours, fno, rtol=0, atol=1e-13)


def test_draws_are_scaled_standard_normals_in_shell_order():
    m, tau, alpha = 6, 10.0, 2.5
    c = draw_coefficients(5, [3], m, tau, alpha)[0].reshape(m, m)
    xi = np.random.default_rng([5, 3]).standard_normal(m * m)[xi_stream_positions(m)]
    np.testing.assert_array_equal(c, grf_scales(m, tau, alpha) * xi)
    assert c[0, 0] == 0.0
    pos = xi_stream_positions(m)
    assert sorted(pos.ravel()) == list(range(m * m))
    for s in range(1, m):                                 # the shell max(l, k) = s in one block
        assert sorted(pos[:s + 1, :s + 1].ravel()) == list(range((s + 1) ** 2))


def test_a_smaller_truncation_is_the_same_draw_truncated():
    small = draw_coefficients(7, range(4), 8, 3.0, 2.0).reshape(4, 8, 8)
    big = draw_coefficients(7, range(4), 32, 3.0, 2.0).reshape(4, 32, 32)
    np.testing.assert_array_equal(small, big[:, :8, :8])


def test_basis_is_orthonormal_parseval():
    """The trapezoidal rule on 2M+1 nodes is exact for these cosine products: the mean of mu^2
    over the square is the sum of the squared coefficients."""
    m = 12
    c = draw_coefficients(1, range(3), m, 3.0, 2.0)
    t = np.linspace(0.0, 1.0, 2 * m + 1)
    mu = render(c, t, t)
    w = trapezoid_weights((2 * m + 1, 2 * m + 1)).numpy()
    np.testing.assert_allclose((w * mu ** 2).sum(axis=(1, 2)), (c ** 2).sum(axis=1), rtol=1e-12)
    np.testing.assert_allclose((w * mu).sum(axis=(1, 2)), 0.0, atol=1e-14)    # no mean mode


def test_render_is_the_series_at_any_points():
    m = 5
    c = draw_coefficients(2, [0], m, 4.0, 2.0)[0].reshape(m, m)
    rng = np.random.default_rng(1)
    y, x = rng.random(7), rng.random(9)
    phi = lambda k, t: 1.0 if k == 0 else np.sqrt(2) * np.cos(k * np.pi * t)  # noqa: E731
    want = np.array([[sum(c[l, k] * phi(l, yy) * phi(k, xx) for l in range(m) for k in range(m))
                      for xx in x] for yy in y])
    np.testing.assert_allclose(render(c.reshape(1, -1), y, x)[0], want, rtol=0, atol=1e-14)
    np.testing.assert_allclose(cosine_basis(m, [0.0])[0], [1] + [np.sqrt(2)] * (m - 1))


def test_the_same_draw_on_nested_grids():
    coarse, fine = make((33, 33), family="fine-scale"), make((65, 65), family="fine-scale")
    params = coarse.sample_params(271828, range(3))
    np.testing.assert_array_equal(params, fine.sample_params(271828, range(3)))
    np.testing.assert_allclose(fine.mu(params)[:, ::2, ::2], coarse.mu(params), atol=1e-13)
    xc, xf = coarse.build_input(params, torch.float64), fine.build_input(params, torch.float64)
    assert torch.equal(xf[:, :, ::2, ::2], xc)


# -- options --------------------------------------------------------------------------------------
def test_presets_and_overrides():
    b = make()
    assert (b.family, b.alpha, b.tau, b.a_hi, b.a_lo, b.modes) == ("benchmark", 2, 3, 12, 3, 32)
    f = make(family="fine-scale")
    assert (f.alpha, f.tau, f.a_hi, f.a_lo) == (2, 10, 100, 1)
    g = make(family="fine-scale", tau=20, a_hi=1000)
    assert (g.alpha, g.tau, g.a_hi, g.a_lo) == (2, 20, 1000, 1)
    ln = make(coefficient="lognormal", modes=8)
    assert ln.a_hi is None and "a_hi" not in ln.config() and len(ln.param_names) == 64
    assert ln.param_names[:3] == ("c_0_0", "c_0_1", "c_0_2") and ln.param_names[8] == "c_1_0"
    for p in (b, g, ln):
        cfg = json.loads(json.dumps(p.config()))
        assert get_problem("darcy", **cfg).config() == p.config()


@pytest.mark.parametrize("kw,word", [
    ({"family": "fine"}, "family"), ({"tau": 0}, "tau"), ({"tau": -1.0}, "tau"),
    ({"alpha": 1.0}, "alpha"), ({"alpha": float("inf")}, "alpha"), ({"a_hi": -12}, "a_hi"),
    ({"a_lo": 0}, "a_lo"), ({"coefficient": "binary"}, "coefficient"), ({"modes": 1}, "modes"),
    ({"modes": 300}, "modes"), ({"modes": 32.0}, "modes"), ({"source": "one"}, "source"),
    ({"bc_mode": "soft"}, "bc_mode"), ({"quadrature": "gauss"}, "quadrature"),
])
def test_bad_options_name_the_option_and_value(kw, word):
    with pytest.raises(ValueError) as e:
        make(**kw)
    msg = str(e.value)
    assert msg.startswith(word) and repr(list(kw.values())[0]) in msg


def test_lognormal_refuses_the_threshold_values():
    with pytest.raises(ValueError, match=r"a_hi and a_lo .* coefficient='lognormal'.*a_hi=12"):
        make(coefficient="lognormal", a_hi=12)


def test_no_kl_parameters_left_over():
    with pytest.raises(AttributeError):
        make().n_terms                                  # noqa: B018


# -- parameters and coefficient -------------------------------------------------------------------
def test_sampler_bounds_and_spread():
    p = make(modes=4, family="fine-scale")
    draws = p.sample_params(3, range(4000))
    b = p.param_bounds()
    assert b.shape == (16, 2) and np.all(b[0] == 0) and np.all(draws[:, 0] == 0)
    assert np.all(draws >= b[:, 0]) and np.all(draws <= b[:, 1])
    sigma = grf_scales(4, 10.0, 2.0).ravel()
    np.testing.assert_allclose(draws[:, 1:].std(axis=0), sigma[1:], rtol=0.05)  # 4000 draws
    np.testing.assert_array_equal(p.sample_params(3, [17, 2]), draws[[17, 2]])


def test_threshold_coefficient_at_the_nodes():
    p = make((40, 40), family="fine-scale", a_hi=50.0, a_lo=0.5)
    params = p.sample_params(0, range(6))
    mu, x = p.mu(params), p.build_input(params, dtype=torch.float64).numpy()
    np.testing.assert_array_equal(x[:, 0], np.where(mu >= 0, 50.0, 0.5))
    np.testing.assert_array_equal(x[:, 1], np.log(x[:, 0]))
    np.testing.assert_array_equal(p.nu_nodes(params[2]), x[2, 0])
    assert 0.2 < np.mean(x[:, 0] == 50.0) < 0.8 and p.nu_range() == (0.5, 50.0)
    assert p.coefficient_of(np.zeros(1))[0] == 50.0           # mu = 0 is a_hi, as in GRF.m


def test_lognormal_coefficient():
    p = make((24, 24), coefficient="lognormal", modes=16)
    params = p.sample_params(0, range(3))
    mu, x = p.mu(params), p.build_input(params, dtype=torch.float64).numpy()
    np.testing.assert_array_equal(x[:, 1], mu)
    np.testing.assert_array_equal(x[:, 0], np.exp(mu))
    lo, hi = p.nu_range()
    assert lo < x[:, 0].min() and x[:, 0].max() < hi


# -- reference solver -----------------------------------------------------------------------------
def layered_solution(breaks, values, y, x, n_modes=4000):
    """Closed form of -div(a grad u) = 1, u = 0 on the boundary of [0, 1]^2, a = values[i] on
    breaks[i] < x < breaks[i+1]. With a independent of y, u = sum over odd n of sin(n pi y)
    X_n(x) (1 = sum 4 / (n pi) sin(n pi y)), and -(a X')' + a q^2 X = 4 / (n pi), q = n pi, is
    solved exactly in each layer: X = P_i + A_i e^{-q (x - x_i)} + B_i e^{-q (x_{i+1} - x)}
    with P_i = 4 / (n pi a_i q^2), X(0) = X(1) = 0 and X, a X' continuous at the interfaces
    (decaying exponentials: no overflow). The tail beyond n_modes is O(n_modes^-2) (~1e-10)."""
    a, xb = np.asarray(values, float), np.asarray(breaks, float)
    nl, w = len(a), np.diff(xb)
    q = np.arange(1, 2 * n_modes, 2) * np.pi
    e = np.exp(-q[:, None] * w[None, :])
    pp = (4.0 / q)[:, None] / (a[None, :] * q[:, None] ** 2)
    m = np.zeros((len(q), 2 * nl, 2 * nl))
    r = np.zeros((len(q), 2 * nl))
    m[:, 0, 0], m[:, 0, 1], r[:, 0] = 1.0, e[:, 0], -pp[:, 0]
    m[:, 1, -2], m[:, 1, -1], r[:, 1] = e[:, -1], 1.0, -pp[:, -1]
    for i in range(nl - 1):
        k, c = 2 + 2 * i, 2 * i
        m[:, k, c:c + 4] = np.stack([e[:, i], np.ones_like(q), -np.ones_like(q), -e[:, i + 1]], 1)
        r[:, k] = pp[:, i + 1] - pp[:, i]
        m[:, k + 1, c:c + 4] = np.stack([-a[i] * e[:, i], a[i] + 0 * q, a[i + 1] + 0 * q,
                                         -a[i + 1] * e[:, i + 1]], 1)
    ab = np.linalg.solve(m, r[..., None])[..., 0]
    xx = np.zeros((len(q), len(x)))
    for i in range(nl):
        s = (x >= xb[i]) & (x <= xb[i + 1])
        xx[:, s] = (pp[:, i:i + 1] + ab[:, 2 * i:2 * i + 1] * np.exp(-np.outer(q, x[s] - xb[i]))
                    + ab[:, 2 * i + 1:2 * i + 2] * np.exp(-np.outer(q, xb[i + 1] - x[s])))
    return np.sin(np.outer(y, q)) @ xx


def test_layered_closed_form_is_right():
    # constant a = 1: the torsion function of the unit square, 0.0736713532814 at the centre
    c = layered_solution([0, 0.5, 1], [1.0, 1.0], np.array([0.5]), np.array([0.5]))
    assert c[0, 0] == pytest.approx(0.0736713532814, abs=1e-10)
    # a = 2 everywhere halves it; a layer of equal values changes nothing
    t = np.linspace(0, 1, 9)
    np.testing.assert_allclose(layered_solution([0, 0.3, 1], [2.0, 2.0], t, t),
                               0.5 * layered_solution([0, 1], [1.0], t, t), atol=1e-12)


@pytest.mark.parametrize("values", [(3.0, 12.0, 3.0), (1.0, 100.0, 1.0), (100.0, 1.0, 100.0)])
def test_reference_on_a_layered_medium_converges_at_second_order(values):
    """Interfaces at x = 1/4, 3/4, midway between nodes for n - 1 = 2 mod 4 (n = 15, 31, 63,
    127): the harmonic face value is then the exact series conductivity of the two half-cells
    and the error falls by ~4 per refinement (measured 4.1-4.5); the arithmetic one is O(h)."""
    errs = []
    for n in (15, 31, 63, 127):
        p = make((n, n))
        x = p.coords()["x"]
        a = np.tile(np.where((x > 0.25) & (x < 0.75), values[1], values[0]), (n, 1))
        u = p.solve_from_inputs(p.inputs_from_fields({"nu": a[None]})[0])
        exact = layered_solution([0, 0.25, 0.75, 1], values, x, x)
        errs.append(rel_l2(u, exact))
    assert all(errs[i] / errs[i + 1] > 3.8 for i in range(3)), errs
    assert errs[-1] < 1e-3, errs
    arith = solve_diffusion(a, f=1.0, dirichlet="all_zero", face_mean="arithmetic")
    contrast = max(values) / min(values)                   # measured 4x worse at 4, 60x at 100
    assert rel_l2(arith, exact) > (20 if contrast >= 100 else 2) * errs[-1]


@pytest.mark.parametrize("family", ["benchmark", "fine-scale"])
def test_reference_converges_under_refinement_for_thresholded_draws(family):
    """The same draw on nested grids 17 .. 257: successive solutions, compared on the common
    nodes, get closer by ~2 per refinement (first order: interfaces fall anywhere between the
    nodes; measured 1.1-5.8 per step, 9-37 over the four)."""
    kw = {"family": family, "modes": 16}
    params = make(**kw).sample_params(0, range(2))
    for p in params:
        us = [make((n, n), **kw).reference_solution(p) for n in (17, 33, 65, 129, 257)]
        d = [rel_l2(us[i + 1][::2, ::2], us[i]) for i in range(4)]
        assert all(d[i] > d[i + 1] for i in range(3)), d
        assert d[0] / d[3] > 6 and d[3] < 0.015, d


def test_amg_agrees_with_direct_at_high_contrast():
    p = make((65, 65), family="fine-scale", tau=20.0, a_hi=1000.0)
    params = p.sample_params(0, [0])[0]
    direct = p.reference_solution(params, method="direct")
    np.testing.assert_allclose(p.reference_solution(params, method="amg"), direct,
                               rtol=0, atol=1e-9 * np.abs(direct).max())


# -- the energy loss ------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [{}, {"family": "fine-scale"}, {"coefficient": "lognormal"}])
def test_the_reference_is_the_energy_minimiser(kw):
    """The energy is a strictly convex quadratic of the interior values; its gradient vanishes
    at the finite-volume solution and its minimum is -(1/2) integral f u*."""
    p = make((33, 33), source=2.0, **kw)
    params = p.sample_params(4, [0])
    x = p.build_input(params, dtype=torch.float64)
    ref = torch.tensor(p.reference_solution(params[0]))[None, None]
    u = ref.clone().requires_grad_()
    e = p.loss_terms(p.impose(u, x), x)
    (g,) = torch.autograd.grad(e["pde"].sum(), u)
    v = (ref + 0.01 * torch.rand_like(ref)).requires_grad_()
    (g_off,) = torch.autograd.grad(p.loss_terms(p.impose(v, x), x)["pde"].sum(), v)
    assert float(g.abs().max()) < 1e-10 * float(g_off.abs().max())
    assert e["pde"].item() == pytest.approx(-0.5 * p.integrate(2.0 * ref).item(), rel=1e-12)
    assert e["bc"].item() == 0.0


@pytest.mark.parametrize("kw", [{}, {"family": "fine-scale", "output_scale": 0.01}])
def test_ritz_scaling_finds_the_amplitude(kw):
    """ritz=True: any positive multiple of the reference comes out as the reference itself
    (float64); a field off the solution comes out at the energy's minimum along its line
    (the derivative of E(t u) at t = 1 vanishes); a zero field stays zero, not NaN."""
    p = make((33, 33), ritz=True, **kw)
    params = p.sample_params(4, [0, 1])
    x = p.build_input(params, dtype=torch.float64)
    ref = torch.tensor(np.stack([p.reference_solution(q) for q in params]))[:, None]
    raw = ref / p.output_scale * torch.tensor([0.37, 5.0], dtype=torch.float64).view(2, 1, 1, 1)
    torch.testing.assert_close(p.answer(raw, x), ref, rtol=0, atol=1e-10 * float(ref.max()))
    gen = torch.Generator().manual_seed(0)
    u = p.answer(raw * (1 + 0.3 * torch.rand(raw.shape, generator=gen, dtype=raw.dtype)), x)
    t = torch.ones(2, 1, 1, 1, dtype=torch.float64, requires_grad=True)
    (dt,) = torch.autograd.grad(p.loss_terms(t * u, x)["pde"].sum(), t)
    assert float(dt.abs().max()) < 1e-10 * float(p.loss_terms(u, x)["pde"].abs().max())
    assert torch.equal(p.answer(torch.zeros_like(raw), x), torch.zeros_like(raw))
    assert make((16, 16)).config()["ritz"] is False


def test_ritz_fields_find_the_solution_in_their_span():
    """ritz_fields = K: the answer is the energy's minimiser in the span of the K fields
    (float64): a span holding the reference gives the reference; its energy is below every
    single field's Ritz scaling; ritz_fields > 1 without ritz is refused."""
    p = make((33, 33), ritz=True, ritz_fields=3, family="fine-scale", output_scale=0.01)
    assert p.output_channels == 3 and p.config()["ritz_fields"] == 3
    params = p.sample_params(4, [0, 1])
    x = p.build_input(params, dtype=torch.float64)
    ref = torch.tensor(np.stack([p.reference_solution(q) for q in params]))[:, None]
    y, xx = torch.meshgrid(*[torch.linspace(0, 1, 33, dtype=torch.float64)] * 2, indexing="ij")
    s = (torch.sin(np.pi * xx) * torch.sin(2 * np.pi * y)).expand_as(ref)
    raw = torch.cat([(ref + 0.003 * s) / 0.01, 0.5 * s, torch.cos(3 * xx).expand_as(ref)], dim=1)
    u = p.answer(raw, x)
    assert u.shape == ref.shape
    assert rel_l2(u.numpy(), ref.numpy()) < 1e-5  # exact up to the 1e-7 shift of G
    one = make((33, 33), ritz=True, family="fine-scale", output_scale=0.01)
    e = p.loss_terms(u, x)["pde"]
    for i in range(3):
        assert torch.all(e <= one.loss_terms(one.answer(raw[:, i:i + 1], x), x)["pde"] + 1e-15)
    with pytest.raises(ValueError, match="ritz_fields = 2 .* needs ritz = true"):
        make((16, 16), ritz_fields=2)


def test_ritz_fields_given_in_float32_are_combined_as_in_float64():
    """Nearly dependent float32 fields (a common part 1000x the parts that tell them apart,
    as K = 16 network fields can be): the Ritz answer is the float64 one to float32 rounding
    (1.3e-5; with G's products summed in float32: 8e-4)."""
    p = make((33, 33), ritz=True, ritz_fields=3, family="fine-scale", output_scale=0.01)
    x = p.build_input(p.sample_params(4, [0, 1]), dtype=torch.float64)
    y, xx = torch.meshgrid(*[torch.linspace(0, 1, 33, dtype=torch.float64)] * 2, indexing="ij")
    bump = (torch.sin(np.pi * xx) * torch.sin(np.pi * y))[None, None]
    wiggle = torch.stack([torch.sin((i + 2) * np.pi * xx) * torch.sin(np.pi * y)
                          for i in range(3)])[None]
    raw = (1000 * bump + wiggle).expand(2, 3, 33, 33)     # exact in float32 to ~1e-4
    raw32 = raw.float()
    want = p.answer(raw32.double(), x)
    got = p.answer(raw32, x.float())
    assert got.dtype == torch.float32
    assert rel_l2(got.double().numpy(), want.numpy()) < 5e-5      # float32 output rounding x 1000


@pytest.mark.parametrize("name,kw", [("darcy", {}), ("darcy", {"quadrature": "nodes"}),
                                     ("reaction_diffusion", {"quadrature": "nodes"}),
                                     ("reaction_diffusion", {})])
def test_ritz_gram_is_the_polar_of_the_energy(name, kw):
    """The Gram matrix from the energy's weighted squares (one product) is a(u_i, u_j) =
    (a(u_i + u_j) - a(u_i) - a(u_j)) / 2, with a(v, v) = 2 (E(v) + l(v)) from the loss's
    energy E (float64, K = 3, two samples)."""
    p = get_problem(name, grid=(17, 13), ritz=True, ritz_fields=3, **kw)
    x = p.build_input(p.sample_params(2, [0, 1]), dtype=torch.float64)
    u = torch.randn((2, 3, 17, 13), generator=torch.Generator().manual_seed(5),
                    dtype=torch.float64)

    def a(v):                                             # (2,) a(v, v) of one field per sample
        return 2 * (p.loss_terms(v, x)["pde"] + p.integrate(v * p.source))

    g = gram(p.quadratic_features(u, x[:, :1]), 2, 3)
    for i in range(3):
        for j in range(3):
            ui, uj = u[:, i:i + 1], u[:, j:j + 1]
            want = (a(ui + uj) - a(ui) - a(uj)) / 2
            torch.testing.assert_close(g[:, i, j], want, rtol=1e-12, atol=0)
    assert torch.all(torch.linalg.eigvalsh(g) > 0)          # SPD: distinct random fields


@pytest.mark.parametrize("kw", [{}, {"quadrature": "nodes", "bc_mode": "lift",
                                     "coefficient": "lognormal", "output_scale": 0.01}])
def test_loss_terms_per_sample_and_precisions(kw):
    p = make((16, 24), **kw)
    x64 = p.build_input(p.sample_params(1, range(3)), dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    u64 = 0.3 * torch.randn(3, 1, 16, 24, dtype=torch.float64, generator=gen)
    t64 = p.loss_terms(p.impose(u64, x64), x64)
    t32 = p.loss_terms(p.impose(u64.float(), x64.float()), x64.float())
    one = p.loss_terms(p.impose(u64[1:2], x64[1:2]), x64[1:2])
    for k in ("pde", "bc"):
        assert t64[k].shape == (3,) and torch.isfinite(t64[k]).all()
        torch.testing.assert_close(t32[k].double(), t64[k], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(one[k][0], t64[k][1])
    v = p.impose(u64, x64)
    for edge in (v[..., 0, :], v[..., -1, :], v[..., :, 0], v[..., :, -1]):
        assert torch.all(edge == 0)


# -- a coefficient array through deepfusion infer --inputs ----------------------------------------
def test_a_coefficient_array_through_infer_and_solve(tmp_path, monkeypatch, capsys):
    from deepfusion.cli import main
    from deepfusion.app.fields_file import read_fields, write_input_fields
    from deepfusion.engine.checkpoint.store import save_checkpoint
    from diffnet.generators import build_generator

    monkeypatch.setenv("DEEPFUSION_NO_MPI", "1")
    p = make(family="fine-scale", output_scale=0.01)
    torch.manual_seed(0)
    model = build_generator("unet", in_channels=2, depth=2, base_width=4)
    meta = {"step": 0, "config": {"data": {"seed": 0}, "model": {"channels_last": False}},
            "model": {"name": "unet", "kwargs": model.config()},
            "problem": {"name": "darcy", "kwargs": p.config()}}
    ckpt = tmp_path / "step_00000000.h5"
    save_checkpoint(ckpt, model_state=model.state_dict(), optim_state={}, rng_state={}, meta=meta)
    params = p.sample_params(9, range(3))
    a = np.stack([p.nu_nodes(q) for q in params])[:, None]              # (3, 1, 16, 16)
    src, pred, ref = (str(tmp_path / n) for n in ("a.h5", "p.h5", "r.h5"))
    write_input_fields(src, a, ["nu"], problem="darcy")
    assert main(["infer", str(ckpt), "--inputs", src, "--out", pred]) == 0
    assert main(["solve", "--problem", "darcy", "--inputs", src, "--out", ref]) == 0
    out, want = read_fields(pred), read_fields(ref)
    assert out["u"].shape == (3, 16, 16) and np.all(out["u"][:, 0] == 0)
    np.testing.assert_array_equal(out["inputs"][:, 0], a[:, 0])
    np.testing.assert_allclose(out["inputs"][:, 1], np.log(a[:, 0]), atol=1e-6)
    for j in range(3):
        np.testing.assert_allclose(want["u"][j], p.reference_solution(params[j]), rtol=1e-6,
                                   atol=1e-9)
    capsys.readouterr()


def test_the_network_is_built_with_the_fields_the_problem_takes(tmp_path):
    """ritz_fields = K: build_model gives the generator K output channels (a prolonged one
    too, tests/test_recipes.py); a contradicting model.options.out_channels is refused."""
    from deepfusion.app.build import build_model, build_problem
    from deepfusion.config import load_config

    cfg_file = tmp_path / "d.toml"
    cfg_file.write_text('[problem]\nname = "darcy"\ngrid = [16, 16]\n'
                        'options = { ritz = true, ritz_fields = 3 }\n'
                        '[model]\nname = "unet-small"\n[data]\nn_samples = 8\nglobal_batch = 4\n')
    cfg = load_config(str(cfg_file))
    task = build_problem(cfg)
    model, _ = build_model(cfg, task)
    x = task.build_input(task.sample_params(0, range(2)))
    assert model(x).shape == (2, 3, 16, 16) and task.answer(model(x), x).shape == (2, 1, 16, 16)
    cfg = load_config(str(cfg_file), ["model.options={out_channels = 1}"])
    with pytest.raises(ValueError, match="out_channels = 1, but problem 'darcy' takes 3"):
        build_model(cfg, build_problem(cfg))
