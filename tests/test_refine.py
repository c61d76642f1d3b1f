"""Refining an answer with the reference solver: ``Problem.refine`` (a warm start of the
AMG-preconditioned CG from a given answer, or a cold start from zero) and its refusal where the
problem has no iterative reference solver."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from diffnet.problems import get_problem, refines
from tests.test_export import checkpoint

ELLIPTIC = [("poisson", (33, 33)), ("reaction_diffusion", (33, 33)), ("darcy", (33, 33)),
            ("poisson3d", (9, 9, 9))]


@pytest.fixture(scope="module")
def darcy_ckpt(tmp_path_factory):
    """An (untrained) 16x16 Darcy checkpoint as 'deepfusion train' writes it."""
    return checkpoint(tmp_path_factory.mktemp("ck"), "darcy")


def _sample(name, grid):
    p = get_problem(name, grid=grid)
    x = p.build_input(p.sample_params(0, [0]), dtype=torch.float64)[0].numpy()
    return p, x


@pytest.mark.parametrize("name,grid", ELLIPTIC)
def test_warm_start_from_the_reference_answer_needs_no_iteration(name, grid):
    p, x = _sample(name, grid)
    ref = p.solve_from_inputs(x, "direct")
    u, info = p.refine(x, ref, 1e-8)
    assert info["iterations"] == 0 and info["converged"] and info["warm"]
    assert info["residual"] <= 1e-8 and info["initial_residual"] == pytest.approx(info["residual"])
    np.testing.assert_allclose(u, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name,grid", ELLIPTIC)
def test_warm_start_from_a_perturbed_answer_reaches_the_tolerance(name, grid):
    p, x = _sample(name, grid)
    ref = p.solve_from_inputs(x, "direct")
    rng = np.random.default_rng(1)
    guess = ref * (1 + 0.01 * rng.standard_normal(ref.shape))
    u, info = p.refine(x, guess, 1e-8)
    assert info["converged"] and info["residual"] <= 1e-8 < info["initial_residual"]
    assert info["iterations"] > 0
    # the residual reached is the system's own: recomputed from the returned field
    assert p.reference_system(x).residual(u) == pytest.approx(info["residual"], rel=1e-6)
    assert np.abs(u - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("name,grid", ELLIPTIC)
def test_cold_start_equals_the_reference_solve_to_the_tolerance(name, grid):
    p, x = _sample(name, grid)
    ref = p.solve_from_inputs(x, "direct")
    u, info = p.refine(x, None, 1e-10)
    assert not info["warm"] and info["initial_residual"] == 1.0 and info["converged"]
    assert np.abs(u - ref).max() <= 1e-7 * np.abs(ref).max()
    amg = p.solve_from_inputs(x, "amg")
    np.testing.assert_allclose(u, amg, rtol=0, atol=1e-9 * np.abs(ref).max())


def test_one_system_reuses_its_hierarchy_for_a_warm_and_a_cold_start():
    p, x = _sample("darcy", (33, 33))
    system = p.reference_system(x)
    cold, ci = system.refine(None, 1e-8)
    ml = system.ml
    warm, wi = system.refine(cold * 1.001, 1e-8)
    assert system.ml is ml and wi["setup_time"] == ci["setup_time"] > 0
    assert wi["iterations"] < ci["iterations"]
    for key in ("solve_time", "assemble_time", "n_unknowns", "initial_residual"):
        assert key in wi


def test_burgers_refuses_refinement_naming_the_problem():
    p = get_problem("burgers", grid=(16, 16))
    assert not refines(p)
    with pytest.raises(ValueError, match="'burgers' cannot refine"):
        p.refine(np.zeros((1, 16, 16)), None, 1e-8)


@pytest.mark.parametrize("tol", [0.0, 1.0, -1e-8, float("nan"), True])
def test_a_tolerance_outside_zero_one_is_refused(tol):
    p, x = _sample("poisson", (17, 17))
    with pytest.raises(ValueError, match="refinement tolerance"):
        p.refine(x, None, tol)


def test_a_guess_of_the_wrong_shape_or_not_finite_is_refused():
    p, x = _sample("poisson", (17, 17))
    with pytest.raises(ValueError, match=r"grid shape \(17, 17\)"):
        p.refine(x, np.zeros((16, 17)), 1e-8)
    bad = np.zeros((17, 17))
    bad[3, 3] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        p.refine(x, bad, 1e-8)


def test_the_residual_of_a_field_with_nan_is_nan_not_an_error():
    p, x = _sample("poisson", (17, 17))
    bad = p.solve_from_inputs(x, "direct")
    bad[3, 3] = np.nan
    assert np.isnan(p.reference_system(x).residual(bad))


def test_refine_batch_refines_every_answer_and_records_each_outcome():
    from deepfusion.engine.predict.refine import DATASETS, refine_batch, unconverged

    p = get_problem("darcy", grid=(33, 33))
    x = p.build_input(p.sample_params(0, [0, 1]))                  # float32, as infer has it
    ref = np.stack([p.solve_from_inputs(xi, "direct") for xi in x.double().numpy()])
    guess = torch.as_tensor(ref * 1.01, dtype=torch.float32)
    u, rec = refine_batch(p, guess, x, 1e-9)
    assert u.dtype == np.float64 and u.shape == ref.shape and set(rec) == set(DATASETS)
    assert np.all(rec["refine_residual"] <= 1e-9) and unconverged(rec, 1e-9) == []
    assert np.all(rec["refine_initial_residual"] > 1e-9) and np.all(rec["refine_seconds"] > 0)
    assert np.all(rec["refine_iterations"] > 0)
    assert np.abs(u - ref).max() <= 1e-6 * np.abs(ref).max()


def test_bench_refine_times_warm_cold_and_coarse_starts_and_states_the_goal(darcy_ckpt, tmp_path):
    from bench import refine

    out = tmp_path / "refine.json"
    assert refine.main(["--checkpoint", darcy_ckpt, "--sizes", "32", "--samples", "2",
                        "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    size = res["sizes"][0]
    assert size["grid"] == [32, 32] and size["work_grid"] == [16, 16] and len(size["rows"]) == 2
    for row in size["rows"]:
        assert row["setup_s"] > 0 and row["cold"]["converged"] and row["cold"]["iterations"] > 0
        for start in ("warm", "coarse"):
            assert row[start]["residual"] <= 1e-8 and row[start]["pre_s"] > 0
            assert row[start]["guess_error"] >= 0
        assert row["coarse"]["coarse_grid"] == [16, 16]
    goal = refine.goals(res)["refine_speedup_32x32"]
    assert goal["goal"] == 1.0 and goal["met"] == (goal["value"] > 1.0)
    assert goal["value"] == pytest.approx(goal["cold_s"] / goal["warm_s"])


def test_bench_refine_without_a_checkpoint_times_the_cold_and_coarse_starts(tmp_path):
    from bench import refine

    out = tmp_path / "refine.json"
    assert refine.main(["--problem", "poisson3d", "--sizes", "9", "--coarse", "5x5x5",
                        "--samples", "1", "--repeats", "1", "--out", str(out)]) == 0
    size = json.loads(out.read_text())["sizes"][0]
    assert size["grid"] == [9, 9, 9] and "goal" not in size
    assert set(size["summary"]) >= {"cold", "coarse"} and "warm" not in size["summary"]


# -- deepfusion infer --refine and the Python API --------------------------------------------

def test_infer_refine_writes_the_refined_answer_and_its_record(darcy_ckpt, tmp_path, cli):
    import h5py

    out = str(tmp_path / "r.h5")
    rc, said, err = cli(["infer", darcy_ckpt, "--samples", "3", "--batch", "2", "--seed", "7",
                         "--refine", "1e-9", "--out", out])
    assert rc == 0, err
    assert "refined to 1e-09" in said
    p = get_problem("darcy", grid=(16, 16))
    with h5py.File(out) as f:
        assert f.attrs["refined"] and f.attrs["refine_tol"] == 1e-9
        assert f["u"].dtype == np.float64
        u, x = f["u"][()], f["inputs"][()]
        assert np.all(f["refine_residual"][()] <= 1e-9)
        assert np.all(f["refine_initial_residual"][()] > 1e-9)      # an untrained network
        assert f["refine_iterations"].dtype == np.int64 and np.all(f["refine_iterations"][()] > 0)
        assert np.all(f["refine_seconds"][()] > 0)
    for j in range(3):      # the written answer is the reference solver's, to the tolerance
        ref = p.solve_from_inputs(x[j], "direct")
        assert np.abs(u[j] - ref).max() <= 1e-6 * np.abs(ref).max()
    ref = str(tmp_path / "ref.h5")      # compare counts the refinement in the answer's time
    assert cli(["solve", "--problem", "darcy", "--grid", "16x16", "--samples", "3", "--seed",
                "7", "--out", ref])[0] == 0
    rc, said, err = cli(["compare", out, ref, "--out", str(tmp_path)])
    assert rc == 0 and "inference + refinement" in said, err
    assert json.loads((tmp_path / "compare.json").read_text())["refined"]


def test_infer_refine_is_refused_for_burgers_and_for_a_bad_tolerance(darcy_ckpt, tmp_path,
                                                                     cli):
    out = str(tmp_path / "r.h5")
    burgers = checkpoint(tmp_path, "burgers")
    rc, _, err = cli(["infer", burgers, "--samples", "1", "--refine", "1e-8", "--out", out])
    assert rc == 2 and "'burgers' cannot refine" in err and "--refine" in err, err
    rc, _, err = cli(["infer", darcy_ckpt, "--samples", "1", "--refine", "2", "--out", out])
    assert rc == 2 and "refinement tolerance" in err, err
    assert not (tmp_path / "r.h5").exists()


def test_solver_predict_refine_equals_infer_refine(darcy_ckpt, tmp_path, cli):
    import h5py

    import deepfusion

    out = str(tmp_path / "r.h5")
    assert cli(["infer", darcy_ckpt, "--samples", "2", "--seed", "7", "--refine", "1e-9",
                "--threads", "1", "--out", out])[0] == 0
    solver = deepfusion.load(darcy_ckpt, threads=1)
    with h5py.File(out) as f:
        u = solver.predict(f["inputs"][()], refine=1e-9)
        assert u.dtype == np.float64
        np.testing.assert_allclose(u, f["u"][()], rtol=0, atol=1e-12)
        np.testing.assert_array_equal(solver.last_refine["refine_iterations"],
                                      f["refine_iterations"][()])
    burgers = deepfusion.load(checkpoint(tmp_path, "burgers"))
    with pytest.raises(ValueError, match="'burgers' cannot refine"):
        burgers.predict(params=burgers.sample(1), refine=1e-8)


def test_infer_refine_on_two_ranks_writes_what_one_rank_writes(darcy_ckpt, tmp_path, cli):
    import h5py

    from tests.mpi_util import REAL_MPI, deepfusion

    cmd = ["infer", darcy_ckpt, "--samples", "3", "--batch", "1", "--refine", "1e-9",
           "--threads", "1", "--out"]
    p1, p2 = str(tmp_path / "p1.h5"), str(tmp_path / "p2.h5")
    assert cli(cmd + [p1])[0] == 0
    res = deepfusion(2, cmd + [p2], env=REAL_MPI)
    assert res.returncode == 0, res.stderr
    with h5py.File(p1) as a, h5py.File(p2) as b:
        assert b.attrs["ranks"] == 2 and b.attrs["refined"]
        for name in ("u", "refine_iterations", "refine_residual", "refine_initial_residual"):
            np.testing.assert_array_equal(a[name][()], b[name][()])
        assert np.all(b["refine_seconds"][()] > 0)


def test_a_refined_answer_rounded_to_float32_loses_its_residual():
    """Why a refined answer is kept in float64 (docs/refine.md)."""
    p, x = _sample("darcy", (65, 65))
    system = p.reference_system(x)
    u, info = system.refine(None, 1e-10)
    assert info["residual"] <= 1e-10 and system.residual(u.astype(np.float32)) > 1e-6
