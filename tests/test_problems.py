"""Problem families: sampling, validation, inputs, boundary imposition, losses, and the physics
(the reference solution has a small residual; the discrete energy minimiser solves the PDE)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from diffnet.problems import PROBLEMS, Problem, get_problem
from diffnet.problems.check.problem import check_problem
from diffnet.problems.families.diffusion import kl_modes, log_nu_bound

NAMES = sorted(n for n in PROBLEMS if PROBLEMS[n].dims == 2)  # 3-D: tests/test_poisson3d.py
GRID = (16, 24)  # deliberately non-square


def make(name, **kw):
    kw.setdefault("grid", GRID)
    return get_problem(name, **kw)


# -- registry and validation ----------------------------------------------------------------------
def test_registry():
    for name in NAMES:
        p = get_problem(name)
        assert isinstance(p, Problem) and p.name == name
        assert p.grid == (64, 64)
    with pytest.raises(ValueError, match="burgers"):
        get_problem("no_such_problem")


@pytest.mark.parametrize("name", NAMES)
def test_unknown_option(name):
    with pytest.raises(ValueError) as e:
        get_problem(name, grid=GRID, not_an_option=3)
    msg = str(e.value)
    assert "not_an_option" in msg and "grid" in msg  # names the bad one, lists the valid ones


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("grid", [(3, 16), (16, 2), "ab", (16,), None])
def test_bad_grid(name, grid):
    with pytest.raises(ValueError, match="grid"):
        get_problem(name, grid=grid)


@pytest.mark.parametrize("name,kw,word", [
    ("burgers", {"c_range": (6, 3)}, "c_range"),
    ("burgers", {"c_range": (3, 3)}, "c_range"),
    ("burgers", {"c_range": (-1, 3)}, "c_range"),
    ("burgers", {"c_range": "x"}, "c_range"),
    ("burgers", {"bc_weight": -1}, "bc_weight"),
    ("burgers", {"hard_bc": "yes"}, "hard_bc"),
    ("burgers", {"stencil": "fancy"}, "stencil"),
    ("burgers", {"form": "weak"}, "form"),
    ("burgers", {"viscosity": float("nan")}, "viscosity"),
    ("burgers", {"smoothing": 0.1}, "smoothing"),                     # needs lax-oleinik
    ("burgers", {"smoothing": -1, "scheme": "lax-oleinik"}, "smoothing"),
    ("burgers", {"smoothing_until": 0, "scheme": "lax-oleinik"}, "smoothing_until"),
    ("burgers", {"horizon": 4, "scheme": "lax-oleinik"}, "horizon"),
    ("burgers", {"reference": "weno"}, "reference"),
    ("poisson", {"omega_range": (3, -3)}, "omega_range"),
    ("poisson", {"omega_range": (1, 1)}, "omega_range"),
    ("poisson", {"n_terms": 3}, "n_terms"),
    ("poisson", {"n_terms": 4.5}, "n_terms"),
    ("poisson", {"loss": "l1"}, "loss"),
    ("poisson", {"quadrature": "gauss"}, "quadrature"),
    ("poisson", {"stencil": "upwind"}, "stencil"),
    ("reaction_diffusion", {"kappa": -1}, "kappa"),
    ("reaction_diffusion", {"source": "one"}, "source"),
    ("reaction_diffusion", {"omega_range": ()}, "omega_range"),
])
def test_bad_args(name, kw, word):
    with pytest.raises(ValueError) as e:
        make(name, **kw)
    assert word in str(e.value)
    assert repr(list(kw.values())[0])[:3] in str(e.value) or word == "c_range"


@pytest.mark.parametrize("name", NAMES)
def test_config_roundtrip(name):
    """config() through JSON rebuilds the same options, draws and losses (the checker's
    checkpoint round trip, on a non-square grid)."""
    report = check_problem(name, grid=GRID)
    assert [r.status for r in report.results if r.check == "checkpoint round trip"] == ["OK"]


# -- parameters -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_sampler_deterministic_and_bounded(name):
    p = make(name)
    all10 = p.sample_params(7, range(10))
    assert all10.shape == (10, len(p.param_names)) and all10.dtype == np.float64
    np.testing.assert_array_equal(p.sample_params(7, [5])[0], all10[5])
    np.testing.assert_array_equal(p.sample_params(7, [9, 2])[1], all10[2])
    assert not np.array_equal(p.sample_params(8, [5]), p.sample_params(7, [5]))
    b = p.param_bounds()
    assert b.shape == (len(p.param_names), 2)
    big = p.sample_params(0, range(500))
    assert np.all(big >= b[:, 0]) and np.all(big <= b[:, 1])


def test_param_names_and_bounds():
    assert make("burgers").param_names == ("c",)
    np.testing.assert_array_equal(make("burgers", c_range=(3, 16)).param_bounds(), [[3, 16]])
    p = make("poisson", n_terms=6, omega_range=(-2, 1))
    assert p.param_names == tuple(f"omega_{i}" for i in range(1, 7))
    np.testing.assert_array_equal(p.param_bounds(), np.tile([-2.0, 1.0], (6, 1)))
    assert kl_modes(5) == [(0, 1), (1, 0), (1, 1), (0, 2), (2, 0)]
    assert log_nu_bound(4, (-3, 3)) == pytest.approx(3 * (1 / 2 + 1 / 2 + 1 / 3 + 1 / 5))


# -- inputs and imposition ------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_build_input(name, dtype):
    p = make(name)
    params = p.sample_params(0, range(3))
    x = p.build_input(params, dtype=dtype)
    assert x.shape == (3, len(p.input_channels), *GRID) and x.dtype == dtype
    assert torch.isfinite(x).all()
    with pytest.raises(ValueError):
        p.build_input(params[:, :0])


def test_burgers_input_channels():
    p = make("burgers")
    assert p.input_channels == ("u0", "t")
    x = p.build_input(np.array([[4.0]]), dtype=torch.float64)
    xs = p.coords()["x"]
    u0 = 0.5 * (1 - np.cos(2 * np.pi * 4.0 * xs))
    np.testing.assert_allclose(x[0, 0].numpy(), np.tile(u0, (GRID[0], 1)), atol=1e-14)
    np.testing.assert_allclose(x[0, 1, :, 3].numpy(), np.linspace(0, 1, GRID[0]))
    assert p.axes[0].name == "t" and p.axes[0].hi == pytest.approx(1 / 3)


@pytest.mark.parametrize("name", ["poisson", "reaction_diffusion"])
def test_nu_channels(name):
    p = make(name)
    assert p.input_channels[0] == "nu"
    params = p.sample_params(3, range(4))
    x = p.build_input(params, dtype=torch.float64)
    np.testing.assert_allclose(x[:, 0].numpy(), np.exp(x[:, 1].numpy()), rtol=1e-13)
    np.testing.assert_allclose(x[1, 0].numpy(), p.nu_nodes(params[1]), rtol=1e-13)
    lo, hi = p.nu_range()
    assert np.all(x[:, 0].numpy() >= lo * (1 - 1e-12)) and np.all(x[:, 0].numpy() <= hi * (1 + 1e-12))


def test_impose():
    torch.manual_seed(0)
    u = torch.randn(2, 1, *GRID)
    # Burgers: soft by default (identity), hard on request.
    p = make("burgers")
    x = p.build_input(p.sample_params(0, range(2)))
    assert torch.equal(p.impose(u, x), u)
    ph = make("burgers", hard_bc=True)
    v = ph.impose(u, x)
    assert torch.equal(v[:, 0, 0, :], x[:, 0, 0, :])
    assert torch.all(v[:, 0, :, 0] == 0)
    assert torch.equal(v[:, :, 1:, 1:], u[:, :, 1:, 1:])
    assert torch.all(ph.loss_terms(v, x)["bc"] == 0)
    assert torch.all(p.loss_terms(u, x)["bc"] > 0)
    # Poisson: always hard, 1 at x = 0 and 0 at x = 1.
    p = make("poisson")
    x = p.build_input(p.sample_params(0, range(2)))
    v = p.impose(u, x)
    assert torch.all(v[..., 0] == 1) and torch.all(v[..., -1] == 0)
    assert torch.equal(v[..., 1:-1], u[..., 1:-1])
    # Reaction-diffusion: zero on the whole boundary.
    p = make("reaction_diffusion")
    v = p.impose(u, x)
    for edge in (v[..., 0, :], v[..., -1, :], v[..., :, 0], v[..., :, -1]):
        assert torch.all(edge == 0)
    assert torch.equal(v[..., 1:-1, 1:-1], u[..., 1:-1, 1:-1])


# -- losses ---------------------------------------------------------------------------------------
OPTION_SETS = [
    ("burgers", {}), ("burgers", {"form": "advective", "viscosity": 1e-3, "stencil": "central"}),
    ("burgers", {"hard_bc": True, "stencil": "sobel3103"}),
    ("burgers", {"scheme": "lax-oleinik", "hard_bc": True}),
    ("burgers", {"scheme": "lax-oleinik", "smoothing": 0.2}),
    ("poisson", {}), ("poisson", {"quadrature": "nodes"}), ("poisson", {"loss": "residual"}),
    ("reaction_diffusion", {}), ("reaction_diffusion", {"quadrature": "nodes", "kappa": 1.0}),
]


@pytest.mark.parametrize("name,kw", OPTION_SETS)
def test_loss_terms(name, kw):
    # shapes, dtypes, per-sample terms, gradient, split and round trip: the public checker
    check_problem(name, grid=GRID, options=kw).assert_ok()
    p = make(name, **kw)
    params = p.sample_params(1, range(3))
    torch.manual_seed(0)
    u64 = torch.randn(3, 1, *GRID, dtype=torch.float64) * 0.3
    x64 = p.build_input(params, dtype=torch.float64)
    out = {dtype: p.loss_terms(p.impose(u64.to(dtype), x64.to(dtype)), x64.to(dtype))
           for dtype in (torch.float64, torch.float32)}
    for k in ("pde", "bc"):
        torch.testing.assert_close(out[torch.float32][k].double(), out[torch.float64][k],
                                   rtol=1e-4, atol=1e-5)
    # channels_last memory format gives the same values
    ucl = p.impose(u64.contiguous(memory_format=torch.channels_last), x64)
    xcl = x64.contiguous(memory_format=torch.channels_last)
    cl = p.loss_terms(ucl, xcl)
    for k in ("pde", "bc"):
        torch.testing.assert_close(cl[k], out[torch.float64][k])


def test_energy_values_exact():
    # nu = 1, u = 1 - x: energy 1/2 exactly (either quadrature), residual 0.
    for kw in ({}, {"quadrature": "nodes"}, {"loss": "residual"}):
        p = make("poisson", **kw)
        params = np.zeros((1, 4))
        x = p.build_input(params, dtype=torch.float64)
        u = torch.tensor(np.tile(1 - p.coords()["x"], (GRID[0], 1)))[None, None]
        t = p.loss_terms(p.impose(u, x), x)
        want = 0.0 if kw.get("loss") == "residual" else 0.5
        assert float(t["pde"][0]) == pytest.approx(want, abs=1e-12)
        assert float(t["bc"][0]) == pytest.approx(0.0, abs=1e-12)
    # RD with u = s sin(pi x) sin(pi y), nu = 1: energy -> s^2 (2 pi^2 + kappa^2) / 8 - 4 s / pi^2
    p = get_problem("reaction_diffusion", grid=(129, 129), kappa=2.0)
    c = p.coords()
    u = 0.3 * np.outer(np.sin(np.pi * c["y"]), np.sin(np.pi * c["x"]))
    x = p.build_input(np.zeros((1, 4)), dtype=torch.float64)
    e = float(p.loss_terms(torch.tensor(u)[None, None], x)["pde"][0])
    assert e == pytest.approx(0.09 * (2 * np.pi**2 + 4) / 8 - 1.2 / np.pi**2, rel=1e-3)


def test_burgers_reference_residual_small_pre_shock():
    c = 3.0
    errs = []
    for n in (64, 128):
        p = get_problem("burgers", grid=(n, n))
        ref = torch.tensor(p.reference_solution(np.array([c])))[None, None]
        x = p.build_input(np.array([[c]]), dtype=torch.float64)
        t, xs = np.meshgrid(p.coords()["t"], p.coords()["x"], indexing="ij")
        rows = p.coords()["t"] < 0.5 / (np.pi * c)          # half the breaking time 1/(pi c)
        pert = ref + 0.05 * torch.tensor(np.sin(np.pi * xs) * np.sin(3 * np.pi * t))[None, None]
        r_ref = float(p.pde_residual(ref)[0, 0][rows].square().mean())
        r_pert = float(p.pde_residual(pert)[0, 0][rows].square().mean())
        errs.append(r_ref)
        assert p.loss_terms(ref, x)["bc"].item() == pytest.approx(0.0, abs=1e-20)
    assert r_ref < 0.05 * r_pert          # at 128: ~0.017
    assert errs[1] < 0.3 * errs[0]        # residual of the reference shrinks under refinement


@pytest.mark.parametrize("scheme", ["upwind", "muscl"])
def test_burgers_k_step_residuals_share_one_march(scheme):
    """The k-step residuals of one shared march (k = 1, 2, 4, ..., 16) are those of separate
    marches of k steps each, bit for bit; their gradients agree to rounding (the shared graph
    adds the residuals' contributions in another order)."""
    p = get_problem("burgers", grid=(32, 24), scheme=scheme, horizon=16, c_range=(3, 6))
    x = p.build_input(np.array([[4.0], [5.5]]), dtype=torch.float64)
    noise = torch.rand(2, 1, 32, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    u = x[:, :1] + 0.1 * noise
    shared_u, separate_u = u.clone().requires_grad_(True), u.clone().requires_grad_(True)
    shared = p._fv_residuals(shared_u)
    separate = []
    for k in p.horizons():                 # the definition: k steps from row i - k
        v = separate_u[..., :-k, :]
        for _ in range(k):
            v = p.step(v)
        r = torch.zeros_like(separate_u)
        r[..., k:, 1:] = ((separate_u[..., k:, :] - v) / (k * p.spacing[0]))[..., 1:]
        separate.append(r)
    assert p.horizons() == (1, 2, 4, 8, 16) and len(shared) == len(separate)
    for a, b in zip(shared, separate):
        assert torch.equal(a, b)
    sum(r.square().sum() for r in shared).backward()
    sum(r.square().sum() for r in separate).backward()
    torch.testing.assert_close(shared_u.grad, separate_u.grad, rtol=1e-12, atol=0)


def test_burgers_reference_solution():
    p = get_problem("burgers", grid=(32, 32), c_range=(3, 16))
    ref = p.reference_solution(np.array([10.0]))
    assert ref.shape == (32, 32)
    xs = p.coords()["x"]
    np.testing.assert_allclose(ref[0], 0.5 * (1 - np.cos(2 * np.pi * 10 * xs)), atol=1e-12)
    assert np.all(np.abs(ref[:, 0]) < 1e-12) and ref.min() >= -1e-12 and ref.max() <= 1 + 1e-12


def test_poisson_reference_constant_nu():
    p = make("poisson")
    ref = p.reference_solution(np.zeros(4))
    np.testing.assert_allclose(ref, np.tile(1 - p.coords()["x"], (GRID[0], 1)), atol=1e-10)


# -- the minimiser of the discrete energy solves the PDE ------------------------------------------
def minimise_energy(p, params, iters=4000):
    """Minimise the problem's discrete loss over a free field u (float64, L-BFGS)."""
    x = p.build_input(np.atleast_2d(params), dtype=torch.float64)
    u = torch.zeros(1, 1, *p.grid, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([u], lr=1, max_iter=iters, history_size=50, tolerance_grad=1e-11,
                            tolerance_change=1e-16, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = sum(t.sum() for t in p.loss_terms(p.impose(u, x), x).values())
        loss.backward()
        return loss

    opt.step(closure)
    return p.impose(u.detach(), x)[0, 0].numpy()


def rel_l2(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("name", [pytest.param("poisson", marks=pytest.mark.full),
                                  "reaction_diffusion"])
def test_energy_minimiser_solves_pde(name):
    params = np.array([1.5, -2.0, 1.0, 2.5])       # nu from 0.17 to 6.8
    fine = get_problem(name, grid=(129, 129)).reference_solution(params)
    errs = []
    for n in (17, 33):
        p = get_problem(name, grid=(n, n))
        u = minimise_energy(p, params)
        same = p.reference_solution(params)
        assert rel_l2(u, same) < 1e-4          # minimiser == the finite-volume solution
        s = 128 // (n - 1)
        errs.append(rel_l2(u, fine[::s, ::s]))
    assert errs[0] < 0.03 and errs[1] < 0.02   # vs the fine-grid solution of the PDE
    assert errs[1] < 0.35 * errs[0]            # ... at second order (ratio ~0.25)
