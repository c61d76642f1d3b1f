"""The 3-D generalised Poisson problem ("poisson3d"): options and their refusals, parameters and
the documented KL field, inputs on (D, H, W) grids, exact Dirichlet values, the energy loss's
exact discrete consistency with the 7-point reference solver (zero gradient at the reference,
E(u* + v) - E(u*) = v.A v / 2), the residual ablation, fields and reference solutions.
Tiny non-cubic grids so that an axis mix-up shows."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from diffnet.problems import PROBLEMS, get_problem, option_names
from diffnet.problems.families.diffusion import kl_modes, log_nu_bound
from diffnet.reference import assemble_diffusion
from diffnet.stencils import KINDS

GRID = (8, 10, 12)   # (D, H, W) = (z, y, x)
F64 = torch.float64


def make(**kw):
    kw.setdefault("grid", GRID)
    return get_problem("poisson3d", **kw)


def inputs(p, n=3, seed=0, dtype=F64):
    params = p.sample_params(seed, range(n))
    return params, p.build_input(params, dtype=dtype)


# -- options ---------------------------------------------------------------------------------------
def test_registry_defaults_and_config_round_trip():
    p = get_problem("poisson3d")
    assert PROBLEMS["poisson3d"] is type(p) and p.name == "poisson3d" and p.dims == 3
    assert p.grid == (32, 32, 32) and [a.name for a in p.axes] == ["z", "y", "x"]
    assert (p.loss, p.quadrature, p.stencil, p.bc_mode, p.n_terms) == (
        "energy", "faces", "sobel", "overwrite", 4)
    q = make(n_terms=6, omega_range=(-2, 1), loss="residual", stencil="central", bc_weight=3,
             bc_mode="lift", quadrature="nodes")
    cfg = json.loads(json.dumps(q.config()))           # what a checkpoint stores
    assert set(cfg) == set(option_names("poisson3d"))
    assert get_problem("poisson3d", **cfg).config() == q.config()


@pytest.mark.parametrize("kw, word, valid", [
    ({"grid": (16, 16)}, "grid", "(D, H, W)"),
    ({"grid": (16, 3, 16)}, "grid", "at least 4 nodes"),
    ({"grid": "abc"}, "grid", "(D, H, W)"),
    ({"grid": (16, 16, 16.5)}, "grid", "integers"),
    ({"n_terms": 3}, "n_terms", "integer >= 4"),
    ({"n_terms": 4.0}, "n_terms", "integer >= 4"),
    ({"omega_range": (3, -3)}, "omega_range", "lo < hi"),
    ({"loss": "l1"}, "loss", "('energy', 'residual')"),
    ({"quadrature": "gauss"}, "quadrature", "('faces', 'nodes')"),
    ({"stencil": "upwind"}, "stencil", str(KINDS)),
    ({"bc_mode": "soft"}, "bc_mode", "('overwrite', 'lift')"),
    ({"bc_weight": -1}, "bc_weight", ">= 0"),
])
def test_bad_options_name_the_option_and_the_valid_values(kw, word, valid):
    with pytest.raises(ValueError) as e:
        make(**kw)
    msg = str(e.value)
    assert word in msg and valid in msg and repr(list(kw.values())[0])[:3] in msg


def test_unknown_option_lists_the_valid_ones():
    with pytest.raises(ValueError) as e:
        make(kappa=1.0)
    assert "kappa" in str(e.value) and "omega_range" in str(e.value)


# -- parameters and the KL field -------------------------------------------------------------------
def test_sampler_deterministic_and_bounded():
    p = make(n_terms=5, omega_range=(-2, 1))
    assert p.param_names == tuple(f"omega_{i}" for i in range(1, 6))
    all10 = p.sample_params(7, range(10))
    np.testing.assert_array_equal(p.sample_params(7, [9, 2])[1], all10[2])
    big = p.sample_params(0, range(300))
    assert big.shape == (300, 5) and big.min() >= -2 and big.max() <= 1


def test_documented_modes_and_bounds():
    assert kl_modes(6, 3) == [(0, 1, 1), (1, 0, 1), (1, 1, 0), (1, 1, 1), (0, 1, 2), (0, 2, 1)]
    assert log_nu_bound(4, (-3, 3), 3) == pytest.approx(3 * (3 / 3 + 1 / 4))
    assert log_nu_bound(6, (-3, 3), 3) == pytest.approx(4.75)
    lo, hi = make().nu_range()
    assert lo == pytest.approx(np.exp(-3.75)) and hi == pytest.approx(np.exp(3.75))


def test_nu_is_the_documented_formula_on_the_z_y_x_grid():
    """log nu(z, y, x) = sum omega_i cos(k pi x) cos(l pi y) cos(m pi z) / (1 + k^2 + l^2 + m^2)
    at node [k_z, j_y, i_x] (axes (z, y, x), each on [0, 1])."""
    p = make()
    omega = np.array([[1.5, -2.0, 0.7, 2.9]])
    x = p.build_input(omega)
    assert x.shape == (1, 2, *GRID) and x.dtype == torch.float32
    x = p.build_input(omega, dtype=F64)[0]
    z, y, xs = np.meshgrid(*(np.linspace(0, 1, n) for n in GRID), indexing="ij")
    want = sum(w * np.cos(k * np.pi * xs) * np.cos(l * np.pi * y) * np.cos(m * np.pi * z)
               / (1 + k * k + l * l + m * m) for w, (k, l, m) in zip(omega[0], kl_modes(4, 3)))
    np.testing.assert_allclose(x[1].numpy(), want, rtol=0, atol=1e-13)
    np.testing.assert_allclose(x[0].numpy(), np.exp(want), rtol=1e-13)
    np.testing.assert_allclose(p.nu_nodes(omega[0]), np.exp(want), rtol=1e-13)


def test_inputs_are_within_the_family_range_and_solutions_are_genuinely_3d():
    """Every draw's nu lies in nu_range(); the reference solution varies along z and along y
    (with single-axis modes in the sum it would not: see diffnet.problems.families.diffusion)."""
    p = make()
    params, x = inputs(p, n=4)
    lo, hi = p.nu_range()
    assert x[:, 0].min() >= lo * (1 - 1e-12) and x[:, 0].max() <= hi * (1 + 1e-12)
    for j in range(2):
        u = p.reference_solution(params[j])
        assert np.ptp(u, axis=0).max() > 0.05 and np.ptp(u, axis=1).max() > 0.05


# -- boundary values -------------------------------------------------------------------------------
@pytest.mark.parametrize("bc_mode", ["overwrite", "lift"])
def test_impose_makes_the_dirichlet_faces_exact(bc_mode):
    p = make(bc_mode=bc_mode)
    _, x = inputs(p, n=2)
    u = torch.randn(2, 1, *GRID, dtype=F64, requires_grad=True)
    v = p.impose(u, x)
    assert torch.all(v[..., 0] == 1) and torch.all(v[..., -1] == 0)
    if bc_mode == "overwrite":
        assert torch.equal(v[..., 1:-1], u[..., 1:-1])
    v.sum().backward()
    assert torch.all(u.grad[..., [0, -1]] == 0) and torch.all(u.grad[..., 1:-1] != 0)


# -- the energy loss and the reference solver ------------------------------------------------------
@pytest.mark.parametrize("kw", [{}, {"quadrature": "nodes"}, {"loss": "residual"}])
def test_constant_nu_linear_solution_exact_values(kw):
    """nu = 1, u = 1 - x: energy 1/2 exactly (either quadrature), residual and bc 0."""
    p = make(**kw)
    x = p.build_input(np.zeros((1, 4)), dtype=F64)
    u = torch.tensor(1 - p.coords()["x"]).expand(1, 1, *GRID)
    t = p.loss_terms(p.impose(u, x), x)
    want = 0.0 if kw.get("loss") == "residual" else 0.5
    assert float(t["pde"][0]) == pytest.approx(want, abs=1e-12)
    assert float(t["bc"][0]) == pytest.approx(0.0, abs=1e-12)


def energy_and_grad(p, u, x):
    u = u.clone().requires_grad_()
    e = p.loss_terms(p.impose(u, x), x)["pde"]
    e.sum().backward()
    return e.detach(), u.grad[..., 1:-1]          # the free nodes (x-faces are Dirichlet)


def test_energy_gradient_vanishes_at_the_reference_solution():
    """The "faces" energy is u.A u / 2 with the solver's own conductances, so its gradient at
    the free nodes is the residual of the direct solve: ~1e-16 against O(1) for a perturbed
    field (bound 1e-10 relative)."""
    p = make()
    params, x = inputs(p, n=2)
    ref = torch.tensor(np.stack([p.reference_solution(q, method="direct") for q in params]))
    e_ref, g_ref = energy_and_grad(p, ref[:, None], x)
    g = torch.Generator().manual_seed(1)
    pert = ref[:, None] + 0.05 * torch.randn(ref[:, None].shape, generator=g, dtype=F64)
    e_pert, g_pert = energy_and_grad(p, pert, x)
    assert g_ref.abs().max() <= 1e-10 * g_pert.abs().max()
    assert torch.all(e_ref < e_pert)


@pytest.mark.parametrize("kw", [{}, {"quadrature": "nodes", "stencil": "central"},
                                {"loss": "residual"}])
def test_a_field_constant_along_z_has_the_2d_loss_of_its_slice(kw):
    """One loss for 2-D and 3-D: u and nu constant along z give the 2-D problem's "pde" term
    of the (y, x) slice (per unit volume vs per unit area: the same number), to rounding."""
    p3, p2 = make(**kw), get_problem("poisson", grid=GRID[1:], **kw)
    _, x2 = inputs(p2, n=2)
    x3 = x2[:, :, None].expand(-1, -1, GRID[0], -1, -1)
    g = torch.Generator().manual_seed(6)
    raw = torch.randn((2, 1, *GRID[1:]), generator=g, dtype=F64)
    t2 = p2.loss_terms(p2.impose(raw, x2), x2)
    t3 = p3.loss_terms(p3.impose(raw[:, :, None].expand(-1, -1, GRID[0], -1, -1), x3), x3)
    torch.testing.assert_close(t3["pde"], t2["pde"], rtol=1e-12, atol=0)


def test_energy_is_the_solver_quadratic_form():
    """E(u* + v) - E(u*) = v_I.A v_I / 2 with A = assemble_diffusion's matrix (unit cube:
    the energy is normalised by the volume 1), to 1e-10 relative: the loss and the reference
    are the same discrete problem, so the loss's minimiser IS the reference solution."""
    p = make()
    params, x = inputs(p, n=1, seed=3)
    nu = x[0, 0].numpy()
    a, _, free, _ = assemble_diffusion(nu)
    ref = torch.tensor(p.reference_solution(params[0], method="direct"))[None, None]
    rng = np.random.default_rng(4)
    for _ in range(3):
        v = np.zeros(GRID)
        v[free] = rng.standard_normal(int(free.sum()))
        e0 = p.loss_terms(p.impose(ref, x), x)["pde"].item()
        e1 = p.loss_terms(p.impose(ref + torch.tensor(v)[None, None], x), x)["pde"].item()
        quad = 0.5 * v[free] @ (a @ v[free])
        assert e1 - e0 == pytest.approx(quad, rel=1e-10)
        assert e1 > e0


def test_residual_loss_small_at_the_reference_and_large_off_it():
    p = make(loss="residual")
    params, x = inputs(p, n=2)
    ref = torch.tensor(np.stack([p.reference_solution(q) for q in params]))[:, None]
    g = torch.Generator().manual_seed(2)
    pert = p.impose(ref + 0.05 * torch.randn(ref.shape, generator=g, dtype=F64), x)
    at, off = p.loss_terms(ref, x), p.loss_terms(pert, x)
    assert torch.all(at["pde"] < 1e-3 * off["pde"]) and torch.all(at["bc"] < 1e-3 * off["bc"])


@pytest.mark.parametrize("kw", [{}, {"quadrature": "nodes", "stencil": "central"},
                                {"loss": "residual", "stencil": "sobel3103"},
                                {"bc_mode": "lift"}])
def test_loss_terms_per_sample_dtypes_and_layouts(kw):
    p = make(**kw)
    _, x64 = inputs(p, n=3, seed=1)
    torch.manual_seed(0)
    u64 = 0.3 * torch.randn(3, 1, *GRID, dtype=F64)
    out = {}
    for dtype in (torch.float32, F64):
        u = p.impose(u64.to(dtype).requires_grad_(), x64.to(dtype))
        terms = p.loss_terms(u, x64.to(dtype))
        assert set(terms) == set(p.loss_term_names) == {"pde", "bc"}
        for v in terms.values():
            assert v.shape == (3,) and v.dtype == dtype and torch.isfinite(v).all()
        sum(t.sum() for t in terms.values()).backward()
        out[dtype] = terms
    for k in ("pde", "bc"):
        torch.testing.assert_close(out[torch.float32][k].double(), out[F64][k],
                                   rtol=1e-4, atol=1e-5)
    one = p.loss_terms(p.impose(u64[1:2], x64[1:2]), x64[1:2])        # per sample
    cl = torch.channels_last_3d
    ucl = p.impose(u64.contiguous(memory_format=cl), x64.contiguous(memory_format=cl))
    layout = p.loss_terms(ucl, x64.contiguous(memory_format=cl))
    for k in ("pde", "bc"):
        torch.testing.assert_close(one[k][0], out[F64][k][1])
        torch.testing.assert_close(layout[k], out[F64][k])


# -- fields, reference methods ---------------------------------------------------------------------
def test_inputs_from_fields_round_trip_and_derive_log_nu():
    p = make()
    _, x = inputs(p, n=2)
    x = x.numpy()
    got = p.inputs_from_fields({"log_nu": x[:, 1], "nu": torch.from_numpy(x[:, 0])})
    np.testing.assert_array_equal(got, x)
    got = p.inputs_from_fields({"nu": x[:, 0]})
    np.testing.assert_allclose(got[:, 1], x[:, 1], rtol=0, atol=1e-12)


def test_bad_fields_are_refused_with_the_reason():
    p = make()
    _, x = inputs(p, n=2)
    nu = x[:, 0].numpy().copy()
    with pytest.raises(ValueError, match="8x10x12"):
        p.inputs_from_fields({"nu": np.ones((2, 8, 10, 10))})
    with pytest.raises(ValueError, match=r"4-D array \(N, D, H, W\)"):
        p.inputs_from_fields({"nu": nu[0]})
    with pytest.raises(ValueError, match="same number of samples"):
        p.inputs_from_fields({"nu": nu, "log_nu": np.log(nu[:1])})
    with pytest.raises(ValueError, match=r"missing \['nu'\]"):
        p.inputs_from_fields({"log_nu": np.log(nu)})
    with pytest.raises(ValueError, match=r"unknown \['extra'\]"):
        p.inputs_from_fields({"nu": nu, "extra": nu})
    bad = nu.copy()
    bad[0, 1, 2, 3] = np.nan
    with pytest.raises(ValueError, match="field 'nu' must be finite everywhere"):
        p.inputs_from_fields({"nu": bad})
    nu[1, 2, 3, 4] = 0.0
    with pytest.raises(ValueError, match=r"'nu'.*> 0 everywhere"):
        p.inputs_from_fields({"nu": nu})
    with pytest.raises(ValueError, match="dict of channel name"):
        p.inputs_from_fields({})


def test_reference_methods_agree_and_solve_from_inputs_reads_only_nu():
    p = make()
    params, x = inputs(p, n=1)
    ref = p.reference_solution(params[0])
    assert ref.shape == GRID and ref.dtype == np.float64
    np.testing.assert_allclose(p.reference_solution(params[0], method="amg"), ref, atol=1e-8)
    sample = x[0].numpy().copy()
    np.testing.assert_allclose(p.solve_from_inputs(sample, method="direct"), ref, atol=1e-12)
    sample[1] = 0.0                                      # log_nu is not read
    np.testing.assert_allclose(p.solve_from_inputs(sample), ref, atol=1e-12)
    with pytest.raises(ValueError, match=r"\(C, D, H, W\) = \(2, 8, 10, 12\)"):
        p.solve_from_inputs(sample[:1])
    with pytest.raises(ValueError) as e:
        p.reference_solution(params[0], method="cg")
    assert "reference method" in str(e.value) and "('auto', 'direct', 'amg')" in str(e.value)


def test_a_3d_unet_learns_on_the_energy():
    """The pieces fit: UNet3D on the problem's inputs, hard Dirichlet values, the energy; 30
    Adam steps on one draw lower the energy toward the reference minimum (float64, 8x8x16)."""
    from diffnet.generators import build_generator

    torch.manual_seed(0)
    p = make(grid=(8, 8, 16))
    params, x = inputs(p, n=1, seed=5)
    e_min = p.loss_terms(torch.tensor(p.reference_solution(params[0]))[None, None], x)["pde"]
    net = build_generator("unet3d", in_channels=2, depth=2, base_width=4, max_width=8).double()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    energies = []
    for _ in range(30):
        opt.zero_grad()
        e = p.loss_terms(p.impose(net(x), x), x)["pde"].sum()
        e.backward()
        opt.step()
        energies.append(e.item())
    assert energies[-1] < 0.1 * energies[0] and energies[-1] > e_min.item() - 1e-12
