"""The residual an answer carries (Problem.answer_residual, diffnet.problems.contract.answer_check): the
zero field with its boundary values reads 1, the reference solution about 0, a perturbed answer
is flagged; a family without its own has its loss's (tests/test_loss_residual.py)."""
import numpy as np
import pytest
import torch

from diffnet.problems import PROBLEMS, Problem, get_problem, has_answer_residual
from diffnet.problems.contract.answer_check import CELLS, flags, ramp_lift, subdomain_sums

# every other problem on a 17x17 grid; Burgers' u0 needs some nodes per period
SMALL = {"poisson3d": {"grid": (9, 9, 9)}, "burgers": {"grid": (33, 33), "c_range": (1.0, 2.0)}}


def problem_of(name) -> Problem:
    return get_problem(name, **SMALL.get(name, {"grid": (17, 17)}))


def zero_field(p, x) -> torch.Tensor:
    """The field that holds only the boundary (initial) values: zero elsewhere."""
    if p.name == "burgers":
        u = torch.zeros(len(x), 1, *p.grid, dtype=x.dtype)
        u[:, 0, 0, :] = x[:, 0, 0, :]                        # the initial condition, row t = 0
        return u
    return p.answer(torch.zeros(len(x), p.output_channels, *p.grid, dtype=x.dtype), x)


@pytest.fixture(params=sorted(PROBLEMS))
def checked(request):
    """(problem, inputs, reference solutions) of 2 draws; problems without a residual are
    skipped by name."""
    p = problem_of(request.param)
    if not has_answer_residual(p):
        pytest.skip(f"problem {p.name!r} has no answer residual (answer_residual not defined)")
    params = p.sample_params(0, range(2))
    x = p.build_input(params, dtype=torch.float64)
    ref = np.stack([p.reference_solution(q) for q in params])
    return p, x, ref


def test_lift_reads_one(checked):
    """The boundary lift reads 1: the zero field with the boundary values where those are
    zero (Darcy, reaction-diffusion) or are initial values (Burgers); Poisson's u = 1 ramped
    down across the first subdomain."""
    p, x, _ = checked
    zero = zero_field(p, x)
    lift = zero if p.name == "burgers" else ramp_lift(p, zero[:, 0].numpy(), CELLS)
    np.testing.assert_allclose(p.answer_residual(lift, x), 1.0, rtol=1e-12)
    if p.name in ("darcy", "reaction_diffusion", "burgers"):
        np.testing.assert_allclose(p.answer_residual(zero, x), 1.0, rtol=1e-12)


def test_reference_solution_reads_about_zero(checked):
    p, x, ref = checked
    r = p.answer_residual(ref, x)
    assert r.shape == (2,) and r.dtype == np.float64
    assert np.all(r < 0.05 * p.residual_threshold), r
    assert not flags(r, p.residual_threshold).any()


def test_threshold_flags_a_perturbed_answer(checked):
    """A smooth error of a third of the solution's size, and a NaN answer, are flagged."""
    p, x, ref = checked
    bump = np.sin(np.pi * np.linspace(0, 1, ref.shape[-1]))      # zero on the x-boundaries
    bad = ref + (0.3 * np.abs(ref).max()) * bump
    bad[0] = np.nan
    r = p.answer_residual(torch.from_numpy(bad)[:, None], x)      # (B, 1, *grid) torch too
    assert flags(r, p.residual_threshold).all(), r


def test_answer_residual_refuses_wrong_shapes():
    p = problem_of("darcy")
    x = p.build_input(p.sample_params(0, range(2)))
    with pytest.raises(ValueError, match=r"answers u \(B, H, W\) = \(B, 17, 17\)"):
        p.answer_residual(np.zeros((2, 16, 16)), x)
    with pytest.raises(ValueError, match="the same B"):
        p.answer_residual(np.zeros((3, 17, 17)), x)


def test_a_problem_of_your_own_has_the_residual_of_its_loss():
    """A user's PDE that defines no answer residual has the one derived from its loss
    (diffnet.problems.contract.loss_residual) and no constant threshold: each model's is
    calibrated."""
    from diffnet.problems import residual_kind
    from tests.plugins.heat import Heat

    p = Heat(grid=(9, 9))
    assert has_answer_residual(p) and p.residual_threshold is None
    assert residual_kind(p) == "loss" and residual_kind(get_problem("darcy")) == "family"
    x = p.build_input(p.sample_params(0, range(2)), dtype=torch.float64)
    lift = p.impose(torch.zeros(2, 1, 9, 9, dtype=torch.float64), x)
    np.testing.assert_allclose(p.answer_residual(lift, x), 1.0, rtol=1e-12)
    got = p.check_answers(lift, x)     # no threshold anywhere: only non-finite answers flagged
    assert not got["flagged"].any()
    assert p.check_answers(lift, x, threshold=0.5)["flagged"].all()


def test_subdomain_sums_telescope_interior_fluxes():
    """Summed over a subdomain, the flux between its own nodes cancels: a field that is a pure
    exchange between two nodes of one subdomain sums to zero, one across two does not."""
    r = np.zeros((8, 8))
    r[1, 1], r[1, 2] = 1.0, -1.0                      # inside the first of 2 x 2 subdomains
    assert np.all(subdomain_sums(r, 2) == 0)
    r[1, 2], r[1, 5] = 0.0, -1.0                      # across two subdomains
    np.testing.assert_array_equal(subdomain_sums(r, 2), [[1.0, -1.0], [0.0, 0.0]])
    assert subdomain_sums(np.ones((3, 3, 3)), 4).shape == (3, 3, 3)   # at most one per node


# -- deepfusion infer and the Python API -----------------------------------------------------

def checkpoint(tmp_path, name: str, grid, in_channels: int) -> str:
    """An (untrained) checkpoint of problem ``name`` as 'deepfusion train' writes it."""
    from deepfusion.engine.checkpoint.store import save_checkpoint
    from diffnet.generators import build_generator

    torch.manual_seed(0)
    problem = get_problem(name, grid=grid)
    model = build_generator("unet", in_channels=in_channels, depth=2, base_width=4)
    meta = {"step": 0, "config": {"data": {"seed": 0}, "model": {"channels_last": False}},
            "model": {"name": "unet", "kwargs": model.config()},
            "problem": {"name": name, "kwargs": problem.config()}}
    path = tmp_path / f"{type(problem).__name__}.h5"
    save_checkpoint(path, model_state=model.state_dict(), optim_state={}, rng_state={},
                    meta=meta)
    return str(path)


def test_infer_stores_the_check_and_the_api_returns_it(tmp_path, cli):
    import h5py

    import deepfusion
    from deepfusion.app.fields_file import read_fields

    ck = checkpoint(tmp_path, "darcy", (16, 16), 2)
    out = str(tmp_path / "p.h5")
    rc, stdout, err = cli(["infer", ck, "--samples", "3", "--seed", "5", "--out", out])
    assert rc == 0 and "residual checked: 3 flagged (threshold 0.4, the problem's constant" in stdout
    assert "3 of 3 answers have a residual above 0.4" in err     # an untrained network
    got = read_fields(out)
    assert got["residual"].shape == (3,) and got["residual"].dtype == np.float64
    assert got["flagged"].dtype == bool and got["residual_threshold"] == 0.4
    assert got["residual_threshold_source"] == "family"    # no calibration in the checkpoint
    np.testing.assert_array_equal(got["flagged"], got["residual"] > 0.4)
    p = get_problem("darcy", grid=(16, 16))
    np.testing.assert_allclose(got["residual"], p.answer_residual(got["u"], got["inputs"]),
                               rtol=1e-5)     # the file's float32 inputs against float64 ones
    solver = deepfusion.load(ck)
    solver.predict(params=solver.sample(3, seed=5), check=True)
    np.testing.assert_allclose(solver.last_check["residual"], got["residual"], rtol=1e-6)
    assert solver.last_check["threshold"] == 0.4 and solver.last_check["threshold_source"] == "family"
    assert cli(["infer", ck, "--samples", "2", "--no-check", "--out", out])[0] == 0
    with h5py.File(out) as f:
        assert "residual" not in f and "flagged" not in f


def test_a_plugin_is_checked_too_without_a_threshold_until_calibrated(tmp_path, cli):
    """infer checks every problem's answers by default, a plugin's by the residual of its loss;
    its uncalibrated checkpoint has no threshold, so only non-finite answers are flagged, and
    the file and the line say so."""
    import deepfusion
    from deepfusion.app.fields_file import read_fields

    ck = checkpoint(tmp_path, "tests.plugins.heat:Heat", (16, 16), 1)
    out = str(tmp_path / "p.h5")
    rc, stdout, err = cli(["infer", ck, "--samples", "2", "--out", out])
    assert rc == 0, err
    assert "residual checked: 0 flagged (threshold none: only non-finite" in stdout
    got = read_fields(out)
    assert got["residual"].shape == (2,) and np.isfinite(got["residual"]).all()
    assert got["residual_threshold"] is None and got["residual_threshold_source"] == "none"
    assert got["residual_kind"] == "loss" and not got["flagged"].any()
    solver = deepfusion.load(ck)
    solver.predict(params=solver.sample(2), check=True)
    assert solver.last_check["threshold"] is None and solver.last_check["threshold_source"] == "none"
    np.testing.assert_allclose(solver.last_check["residual"], got["residual"], rtol=1e-5)
