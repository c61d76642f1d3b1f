"""The answer check's threshold calibrated per model (deepfusion.engine.predict.calibration): the
rule, the record in the checkpoint written by training and by ``deepfusion calibrate`` (atomic,
sealed, the states bit for bit), the threshold every prediction takes from it, and the
fallback of a checkpoint written before calibration."""
import json
import os
import sys

import numpy as np
import pytest
import torch

from deepfusion.engine.checkpoint.store import (latest_checkpoint, load_checkpoint,
                                                save_checkpoint, verify_checkpoint)
from deepfusion.engine.predict import calibration as cal
from diffnet.problems import get_problem
from tests.in_process import deepfusion_here
from tests.mpi_util import REAL_MPI, ROOT, deepfusion
from tests.tiny_configs import TINY, variant

FAMILIES = os.path.join(ROOT, "examples", "families")
if FAMILIES not in sys.path:
    sys.path.insert(0, FAMILIES)      # what PYTHONPATH=examples/families does

# the example plugin (residual form, no residual of its own), 6 validation draws
ADR = variant(TINY, 'problem.name="adr:ADR"', "data.eval_samples=6", "train.epochs=3")


# -- the rule ----------------------------------------------------------------------------------

def test_with_slope_1_the_threshold_is_the_ratio_rule():
    ratios = np.array([2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0])
    errors = np.linspace(0.01, 0.2, ratios.size)
    # the ratios grow with the error: a fitted slope above 1, kept at 1
    for slope in (1.0, None):
        got = cal.calibrate(ratios * errors, errors, slope=slope)
        assert got["slope"]["used"] == 1.0 and got["slope"]["fixed"] == (slope is not None)
        # the 10% quantile of 11 ratios, the lower order statistic: the second smallest
        assert got["level"]["quantile"] == pytest.approx(3.0)
        assert got["threshold"] == pytest.approx(0.05 * 3.0)
        assert got["level"]["min"] == pytest.approx(2.0)
        assert got["level"]["max"] == pytest.approx(12.0)
        v = got["validation"]
        assert v["bad"] == int((errors > 0.05).sum()) and v["bad_flagged"] == v["bad"]
    assert cal.calibrate(ratios * errors, errors)["slope"]["fitted"] > 1
    # a NaN residual, a zero error and a zero residual are left out and counted
    got = cal.calibrate(np.r_[ratios * errors, np.nan, 1.0, 0.0], np.r_[errors, 0.1, 0.0, 0.1])
    assert got["draws"] == ratios.size + 3 and got["used"] == ratios.size
    with pytest.raises(cal.CalibrationError, match="2 of 3 draws .* at least 4"):
        cal.calibrate([0.1, 0.2, np.nan], [0.01, 0.02, 0.03])
    with pytest.raises(ValueError, match="slope must lie in"):
        cal.calibrate(ratios * errors, errors, slope=2.0)


# synthetic (residual, error) pairs: r = c e^b times a log-normal scatter
def pairs(lo, hi, n=16, b=1.0, c=0.5, scatter=0.0, seed=0):
    rng = np.random.default_rng(seed)
    e = np.exp(rng.uniform(np.log(lo), np.log(hi), n))
    return c * e ** b * np.exp(scatter * rng.standard_normal(n)), e


def test_perfectly_correlated_draws_flag_exactly_the_bad_ones():
    r, e = pairs(0.005, 0.3, n=20, b=0.5)       # good and bad answers on one law, slope 0.5
    got = cal.calibrate(r, e)
    assert got["slope"]["used"] == pytest.approx(0.5) and got["slope"]["scatter"] < 1e-9
    assert got["threshold"] == pytest.approx(0.5 * 0.05 ** 0.5)
    v = got["validation"]
    assert 0 < v["bad"] < 20 and v["bad_flagged"] == v["bad"] and v["good_flagged"] == 0
    assert got["separation"] == 1.0


def test_all_bad_draws_with_a_floor_still_pass_good_answers():
    """Validation answers all worse than 5%, the residual growing slower than the error (a
    floor): scaled down to 5% along the fitted slope, not in proportion (the ratio rule, which
    flags every answer of the same law)."""
    r, e = pairs(0.1, 0.4, b=0.5, scatter=0.05)
    got, ratio_rule = cal.calibrate(r, e), cal.calibrate(r, e, slope=1.0)
    assert got["validation"]["good"] == 0 and got["separation"] is None
    assert got["slope"]["used"] == pytest.approx(0.5, abs=0.25)
    law = 0.5 * np.array([0.01, 0.02, 0.1, 0.2]) ** 0.5     # answers of 1%, 2%, 10%, 20%
    assert list(law > got["threshold"]) == [False, False, True, True]
    assert (law > ratio_rule["threshold"]).all()


def test_all_good_draws_extrapolate_to_5_percent():
    r, e = pairs(0.003, 0.03, scatter=0.1)        # residual in proportion, all good
    got = cal.calibrate(r, e)
    assert got["validation"]["bad"] == 0 and got["slope"]["used"] > 0.8
    law = 0.5 * np.array([0.01, 0.02, 0.08, 0.2])
    assert list(law > got["threshold"]) == [False, False, True, True]
    # errors all near one value (+-5%): a least-squares slope of chance, pulled towards the
    # prior's 1 (the ratio rule)
    r, e = pairs(0.0095, 0.0105, scatter=0.1, seed=11)
    got = cal.calibrate(r, e)
    assert got["slope"]["fitted"] < -0.5 and got["slope"]["used"] > 0.5


def test_mixed_draws_with_scatter_flag_most_bad_and_few_good():
    r, e = pairs(0.005, 0.2, n=64, b=0.8, scatter=0.15, seed=2)
    got = cal.calibrate(r, e)
    v = got["validation"]
    assert v["bad"] >= 16 and v["good"] >= 16
    assert v["bad_flagged"] >= 0.9 * v["bad"] and v["good_flagged"] <= 0.25 * v["good"]
    assert got["separation"] > 0.9


def test_a_residual_blind_to_the_error_flags_most_answers_and_says_so():
    rng = np.random.default_rng(3)
    e = np.exp(rng.uniform(np.log(0.005), np.log(0.3), 64))
    r = 0.02 * np.exp(0.3 * rng.standard_normal(64))             # uncorrelated with e
    got = cal.calibrate(r, e)
    assert got["slope"]["used"] < cal.BLIND_SLOPE and abs(got["separation"] - 0.5) < 0.15
    flagged = got["validation"]["bad_flagged"] + got["validation"]["good_flagged"]
    assert flagged >= 0.8 * 64
    line = cal.summary_line(cal.record(got, kind="loss", grid=(8, 8), seed=1, step=2, by="t"))
    assert "barely follows the error" in line
    r, e = pairs(0.005, 0.2, n=64, b=0.8, scatter=0.15, seed=2)
    line = cal.summary_line(cal.record(cal.calibrate(r, e), kind="loss", grid=(8, 8), seed=1,
                                       step=2, by="t"))
    assert "barely" not in line and "residual ~ error^0." in line
    # a threshold that flags every good validation answer says so, whatever the slope
    r, e = pairs(0.02, 0.08, n=16, b=1.0, scatter=0.0, seed=4)
    rec = cal.record(cal.calibrate(r * np.where(e > 0.05, 1.0, 3.0), e), kind="loss",
                     grid=(8, 8), seed=1, step=2, by="t")
    assert rec["validation"]["good_flagged"] == rec["validation"]["good"] > 0
    assert "barely follows the error" in cal.summary_line(rec)


def test_a_calibration_on_few_draws_says_how_to_calibrate_on_more():
    r, e = pairs(0.005, 0.2, n=8, b=1.0, scatter=0.1, seed=5)
    few = cal.summary_line(cal.record(cal.calibrate(r, e), kind="loss", grid=(8, 8), seed=1,
                                      step=2, by="t"))
    assert "8 draws are few" in few and "deepfusion calibrate RUN --samples 32" in few
    r, e = pairs(0.005, 0.2, n=cal.FEW_DRAWS, b=1.0, scatter=0.1, seed=5)
    assert "are few" not in cal.summary_line(cal.record(cal.calibrate(r, e), kind="loss",
                                                        grid=(8, 8), seed=1, step=2, by="t"))


def test_a_prediction_takes_the_calibrated_threshold_else_the_familys_else_none():
    darcy, adr = get_problem("darcy", grid=(17, 17)), get_problem("adr:ADR", grid=(17, 17))
    rec = cal.record(cal.calibrate([1.0, 2.0, 3.0, 4.0], [0.1, 0.1, 0.1, 0.1]), kind="family",
                     grid=(17, 17), seed=5, step=7, by="test")
    t = cal.threshold_for({cal.KEY: rec}, darcy)
    assert (t.value, t.source) == (pytest.approx(0.5), "calibrated")
    t = cal.threshold_for({}, darcy)                     # written before calibration
    assert (t.value, t.source) == (0.4, "family") and "no calibrated threshold" in t.text
    t = cal.threshold_for({cal.KEY: rec}, adr)           # calibrated for another residual
    assert (t.value, t.source) == (None, "none") and "'family' residual" in t.text
    assert list(t.flags([0.1, np.inf, np.nan])) == [False, True, True]
    grid = cal.threshold_for({cal.KEY: rec}, get_problem("darcy", grid=(33, 33)))
    assert "calibrated on 17x17, answers on 33x33" in grid.text


def test_writing_a_calibration_keeps_the_checkpoint_bit_for_bit(tmp_path):
    path = str(tmp_path / "step_00000003.h5")
    model = {"w": torch.randn(3, 4), "b": torch.randn(4, dtype=torch.float64)}
    optim = {"state": {0: {"exp_avg": torch.randn(3, 4)}}, "param_groups": [{"lr": 1e-3}]}
    save_checkpoint(path, model_state=model, optim_state=optim, rng_state={"seed": 7},
                    meta={"step": 3})
    before = load_checkpoint(path)
    cal.write(path, {"threshold": 0.25})
    after = load_checkpoint(path)
    assert verify_checkpoint(path) is True and os.listdir(tmp_path) == ["step_00000003.h5"]
    assert after["meta"] == {"step": 3, cal.KEY: {"threshold": 0.25}}
    for k, v in before["model_state"].items():
        assert after["model_state"][k].dtype == v.dtype and torch.equal(after["model_state"][k], v)
    assert torch.equal(after["optim_state"]["state"][0]["exp_avg"],
                       before["optim_state"]["state"][0]["exp_avg"])
    assert after["rng_state"] == before["rng_state"]


# -- training, infer, the Python API and deepfusion calibrate --------------------------------

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("cal")
    cfg = d / "adr.toml"
    cfg.write_text(ADR)
    run_dir = str(d / "run")
    p = deepfusion_here(["train", str(cfg), "--set", f"run.dir={run_dir}"])
    assert p.returncode == 0, p.stderr
    assert "answer check calibrated on 6 draws (seed 12345)" in p.stdout, p.stdout
    return run_dir


def test_training_calibrates_and_every_prediction_uses_it(run, tmp_path, cli):
    import deepfusion
    from deepfusion.app.fields_file import read_fields

    meta = load_checkpoint(latest_checkpoint(run))["meta"]
    rec = meta[cal.KEY]
    assert rec["by"] == "deepfusion train" and rec["residual"] == "loss" and rec["draws"] == 6
    assert rec["seed"] == 12345 and rec["grid"] == [16, 16] and rec["step"] == meta["step"]
    report = json.load(open(os.path.join(run, "eval.json")))     # the same draws' numbers
    again = cal.calibrate(report["residual"], report["rel_l2"])
    assert rec["threshold"] > 0 and rec["threshold"] == pytest.approx(again["threshold"], rel=1e-12)
    out = str(tmp_path / "p.h5")
    rc, stdout, err = cli(["infer", run, "--samples", "4", "--out", out])
    assert rc == 0 and "calibrated for this model" in stdout, err
    got = read_fields(out)
    assert got["residual_threshold"] == pytest.approx(rec["threshold"], rel=1e-12)
    assert got["residual_threshold_source"] == "calibrated" and got["residual_kind"] == "loss"
    np.testing.assert_array_equal(got["flagged"], ~(got["residual"] <= rec["threshold"]))
    solver = deepfusion.load(run)
    solver.predict(params=solver.sample(4), check=True)
    assert solver.last_check["threshold"] == pytest.approx(rec["threshold"], rel=1e-12)
    assert solver.last_check["threshold_source"] == "calibrated"
    rc, stdout, err = cli(["evaluate", run, "--samples", "4", "--out", str(tmp_path / "e.json")])
    assert rc == 0 and "answer check: " in stdout, err
    check = json.load(open(tmp_path / "e.json"))["answer_check"]
    assert check["source"] == "calibrated" and len(check["flagged"]) == 4


def test_the_final_checkpoint_is_written_once_sealed_with_its_calibration(tmp_path, monkeypatch):
    """The final validation runs before the final save: the last checkpoint is written once,
    with the calibration in its metadata, never read back and rewritten."""
    from deepfusion.engine.checkpoint import store
    from deepfusion.engine.checkpoint.store import seal_status

    saved, real = [], store.save_checkpoint

    def counting(path, **kw):
        saved.append((os.path.basename(path), cal.KEY in kw["meta"]))
        return real(path, **kw)

    monkeypatch.setattr(store, "save_checkpoint", counting)
    monkeypatch.setattr(cal, "write", lambda *a, **k: pytest.fail("a checkpoint rewritten"))
    cfg = tmp_path / "adr.toml"
    cfg.write_text(ADR)
    d = str(tmp_path / "run")
    p = deepfusion_here(["train", str(cfg), "--set", f"run.dir={d}"])
    assert p.returncode == 0, p.stderr
    final = latest_checkpoint(d)
    name = os.path.basename(final)
    assert [s for s in saved if s[0] == name] == [(name, True)], saved
    assert all(not has for n, has in saved if n != name)       # only the final one is calibrated
    assert seal_status(final) == "sealed"
    meta = load_checkpoint(final)["meta"]
    assert meta[cal.KEY]["step"] == meta["step"] and meta[cal.KEY]["by"] == "deepfusion train"
    assert f"-> {final}" in p.stdout


def test_calibrate_writes_a_new_threshold_and_refuses_what_it_cannot(run, tmp_path, cli):
    import shutil

    copy = str(tmp_path / "run")
    shutil.copytree(run, copy)
    path = latest_checkpoint(copy)
    before = load_checkpoint(path)
    rc, stdout, err = cli(["calibrate", copy, "--samples", "5", "--seed", "99"])
    assert rc == 0 and "answer check calibrated on 5 draws (seed 99)" in stdout, err
    after = load_checkpoint(path)
    rec = after["meta"][cal.KEY]
    assert rec["by"] == "deepfusion calibrate" and rec["seed"] == 99 and rec["draws"] == 5
    assert all(torch.equal(after["model_state"][k], v) for k, v in before["model_state"].items())
    assert {k: v for k, v in after["meta"].items() if k != cal.KEY} == \
        {k: v for k, v in before["meta"].items() if k != cal.KEY}
    assert not os.path.exists(os.path.join(copy, "lock.json"))     # the write's lock released
    for args, says in ((["--samples", "2"], "--samples must be at least 4"),
                       (["--error", "5"], "--error must be a relative error in (0, 1)")):
        rc, _, err = cli(["calibrate", copy, *args])
        assert rc == 2 and says in err and "Traceback" not in err, err
    rc, _, err = cli(["calibrate", copy, "--seed", "0", "--samples", "4"])
    assert rc == 0 and "WARNING: --seed 0 is the training seed (data.seed)" in err, err


def test_calibration_seeds_are_warned_of_by_the_shared_seed_notes():
    """calibrate's warnings are Loaded.seed_notes(keep_test=True): the training, validation and
    test seeds of the run, and no other."""
    from deepfusion.engine.predict.loader import Loaded

    data = {"seed": 1, "eval_seed": 2, "test_seed": 3}
    loaded = Loaded("c.h5", None, None, None, {"config": {"data": data}})
    said = {s: loaded.seed_notes(s, keep_test=True) for s in (1, 2, 3, 4)}
    assert "training seed (data.seed)" in said[1][0]
    assert "validation draw (data.eval_seed)" in said[2][0]
    assert "test draw (data.test_seed)" in said[3][0] and said[4] == []
    assert loaded.seed_notes(3, held_out=True) == []      # evaluate's default draw: no warning


def test_calibrate_refuses_a_problem_without_a_reference(tmp_path, cli):
    from deepfusion.engine.checkpoint.store import checkpoint_path
    from diffnet.generators import build_generator

    problem = get_problem("tests.plugins.heat:HeatWithoutReference", grid=(16, 16))
    model = build_generator("unet", in_channels=len(problem.input_channels), depth=2,
                            base_width=4)
    meta = {"step": 0, "config": {"data": {"seed": 0}, "model": {"channels_last": False}},
            "model": {"name": "unet", "kwargs": model.config()},
            "problem": {"name": "tests.plugins.heat:HeatWithoutReference",
                        "kwargs": problem.config()}}
    path = checkpoint_path(str(tmp_path), 0)
    save_checkpoint(path, model_state=model.state_dict(), optim_state={}, rng_state={},
                    meta=meta)
    rc, _, err = cli(["calibrate", str(tmp_path)])
    assert rc == 2 and "has no reference solver" in err and "Traceback" not in err


@pytest.mark.mpi
@pytest.mark.full
def test_calibrate_on_two_ranks_writes_what_one_rank_does(run, tmp_path):
    import shutil

    copies = []
    for n in (0, 2):
        copy = str(tmp_path / f"run{n}")
        shutil.copytree(run, copy)
        env = {**REAL_MPI, "PYTHONPATH": f"{FAMILIES}{os.pathsep}{ROOT}"}
        p = deepfusion(n, ["calibrate", copy, "--samples", "6", "--seed", "3"], env=env) \
            if n else deepfusion_here(["calibrate", copy, "--samples", "6", "--seed", "3"])
        assert p.returncode == 0, p.stderr
        copies.append(load_checkpoint(latest_checkpoint(copy))["meta"][cal.KEY])
    assert copies[1]["threshold"] == pytest.approx(copies[0]["threshold"], rel=1e-9)


@pytest.mark.mpi
@pytest.mark.full
def test_a_domain_split_training_calibrates_as_the_undivided_one(run, tmp_path):
    """The final validation under a [1, 2] split checks the whole answers on each group's
    first rank, the plugin's residual on a whole-grid copy of its problem."""
    cfg = tmp_path / "adr.toml"
    cfg.write_text(ADR)
    split = str(tmp_path / "split")
    env = {**REAL_MPI, "PYTHONPATH": f"{FAMILIES}{os.pathsep}{ROOT}"}
    p = deepfusion(2, ["train", str(cfg), "--set", f"run.dir={split}", "--set",
                       "parallel.domain=[1, 2]"], env=env)
    assert p.returncode == 0, p.stderr
    one, two = (load_checkpoint(latest_checkpoint(d))["meta"][cal.KEY] for d in (run, split))
    assert two["threshold"] == pytest.approx(one["threshold"], rel=1e-6)
    assert two["level"] == pytest.approx(one["level"], rel=1e-6)
    assert two["slope"]["used"] == pytest.approx(one["slope"]["used"], rel=1e-6)


def test_a_residual_that_fails_leaves_the_evaluation_whole_and_uncalibrated():
    """A problem's residual that raises: the evaluation's errors are measured as ever, its
    residuals are NaN with a warning, and they calibrate nothing (too few usable draws)."""
    from deepfusion.engine.parallel.comm import SerialComm
    from deepfusion.engine.predict.evaluate import evaluate
    from diffnet.generators import build_generator

    problem = get_problem("darcy", grid=(16, 16))
    model = build_generator("unet", in_channels=2, depth=2, base_width=4)

    def broken(u, inputs):
        raise RuntimeError("no float64 here")
    problem.answer_residual = broken
    with pytest.warns(RuntimeWarning, match="failed on draws 0..3 .*no float64 here"):
        s = evaluate(model, problem, SerialComm(), n=4, seed=1, channels_last=False, check=True)
    assert len(s["rel_l2"]) == 4 and np.isnan(s["residual"]).all()
    with pytest.raises(cal.CalibrationError, match="0 of 4 draws"):
        cal.calibrate(s["residual"], s["rel_l2"])
