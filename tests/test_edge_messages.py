"""Edge cases that used to end in a traceback or a wrong hint (issue #69, items 14, 15, 8, 18):
each is refused or answered with a message that says what is wrong and what to do.

* the Python API's ``predict`` on no samples, on fields without their channel axis, on
  parameters far outside the trained range, with ``batch=0``, and an answer that is not finite;
* a damaged checkpoint's hint: the newest other file that passes its check, or none;
* ``check --resume`` and ``jobs render --run-dir`` on a run whose every checkpoint is damaged;
* a plugin problem whose input channels changed after training.
"""
from __future__ import annotations

import shutil
import warnings

import numpy as np
import pytest
import torch

import deepfusion
from deepfusion.cli import main
from deepfusion.engine.checkpoint.store import CheckpointError, load_checkpoint
from deepfusion.jobs import render as R
from tests.faults.files import flip_bit
from tests.plugins.heat import Heat
from tests.tiny_configs import TINY, variant

STEPS = ("step_00000002.h5", "step_00000004.h5", "step_00000006.h5")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(config, run directory) of a tiny run with checkpoints at steps 2, 4 and 6."""
    d = tmp_path_factory.mktemp("edge")
    cfg = d / "tiny.toml"
    cfg.write_text(variant(TINY, "train.max_steps=6", "train.checkpoint_every=2",
                           "train.keep_checkpoints=3"))
    run = d / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPFUSION_NO_MPI", "1")
        assert main(["train", str(cfg), "--set", f"run.dir={run}"]) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == list(STEPS)
    return str(cfg), run


def copy_run(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def truncate(path, size: int = 1000) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(size)


# -- 14: the Python API's edge cases --------------------------------------------------------------
def test_predict_edge_cases_say_what_is_wrong(trained):
    s = deepfusion.load(trained[1])
    x = s.inputs(s.sample(3))
    u = s.predict(x)
    # no samples: the empty answer, of the kind and dtype asked
    empty = s.predict(x[:0])
    assert isinstance(empty, np.ndarray) and empty.shape == (0, *s.grid) and empty.dtype == u.dtype
    empty = s.predict(torch.from_numpy(x[:0]))
    assert isinstance(empty, torch.Tensor) and tuple(empty.shape) == (0, *s.grid)
    # fields without their channel axis: the shape expected and the channel names
    with pytest.raises(ValueError, match=r"shape \(3, 16, 16\), but fields of shape \(N, C, H, W\) "
                                         r"are expected, C = 2 \['u0', 't'\]: an axis seems missing"):
        s.predict(x[:, 0])
    # one check of batch, at load and at predict
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="batch must be a positive integer"):
            s.predict(x, batch=bad)
    with pytest.raises(ValueError, match="batch must be a positive integer, got 0"):
        deepfusion.load(trained[1], batch=0)
    # parameters far outside the range: refused with the bounds; just outside: answered, warned
    lo, hi = s.param_bounds[0]
    with pytest.raises(ValueError, match=rf"far outside the trained range \[{lo:g}, {hi:g}\]"):
        s.predict(params=[[hi + 100 * (hi - lo)]])
    with pytest.warns(UserWarning, match="outside the trained range"):
        near = s.predict(params=[[hi + 0.5 * (hi - lo)]])
    assert np.isfinite(near).all()
    # an answer that is not finite: a warning naming the samples
    x_bad = x.copy()
    x_bad[1, 0] *= 1e300     # u0 alone: t must stay the rows' time (derived channels are checked)
    with pytest.warns(RuntimeWarning, match=r"1 of 3 samples hold non-finite values .*samples 1;"):
        s.predict(x_bad)
    # valid inputs: answers unchanged, nothing warned
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert np.array_equal(s.predict(x, batch=2), u)


# -- 15: a damaged checkpoint's hint ---------------------------------------------------------------
def test_a_hint_names_only_a_checkpoint_that_passes_its_check(trained, tmp_path):
    run = copy_run(trained[1], tmp_path)
    ck = run / "checkpoints"
    flip_bit(ck / STEPS[2], 8 * 2000)
    truncate(ck / STEPS[1])            # cut short: never the one to use
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ck / STEPS[2])
    assert f"use an earlier one: {ck / STEPS[0]}" in str(e.value)
    truncate(ck / STEPS[0], 0)         # empty: none passes now
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ck / STEPS[2])
    assert f"no other checkpoint in {ck} passes its check" in str(e.value)
    assert STEPS[1] not in str(e.value) and STEPS[0] not in str(e.value)


def test_a_hint_looks_beside_a_checkpoint_kept_outside_its_run(trained, tmp_path):
    saved = tmp_path / "saved"
    shutil.copytree(trained[1] / "checkpoints", saved)
    flip_bit(saved / STEPS[2], 8 * 2000)
    with pytest.raises(CheckpointError, match=f"use an earlier one: {saved / STEPS[1]}"):
        load_checkpoint(saved / STEPS[2])


# -- 8: check and jobs render on a run whose every checkpoint is damaged ------------------------------
def test_check_and_render_refuse_a_run_with_no_loadable_checkpoint(trained, tmp_path, cli):
    cfg, src = trained
    run = copy_run(src, tmp_path)
    rc, _, err = cli(["check", "--resume", str(run), "--ranks", "1", "--no-probe"])
    assert rc == 0 and f"resumes from {run / 'checkpoints' / STEPS[2]}" in err
    for name in STEPS:
        truncate(run / "checkpoints" / name, 0)   # empty: refused without a child process
    rc, _, train_err = cli(["train", "--resume", str(run)])
    refusal = [line for line in train_err.splitlines() if line.startswith("deepfusion: error:")]
    assert rc == 2 and len(refusal) == 1 and "no loadable checkpoint" in refusal[0]
    rc, _, err = cli(["check", "--resume", str(run), "--ranks", "1", "--no-probe"])
    assert rc == 2 and refusal[0] in err.splitlines()
    script = tmp_path / "job.sh"
    rc = R.main(["--cluster", "local", "--ranks-per-node", "1", "--config", cfg,
                 "--run-dir", str(run), "--out", str(script)])
    assert rc == 2 and not script.exists()
    rc = R.main(["--cluster", "local", "--ranks-per-node", "1", "--config", cfg,
                 "--run-dir", str(src), "--out", str(script)])
    assert rc == 0 and script.exists()   # the intact run: resumed


# -- 18: a plugin problem whose input channels changed after training ----------------------------------
def test_changed_input_channels_blame_the_problem_not_the_grid(tmp_path, cli, monkeypatch):
    cfg = tmp_path / "heat.toml"
    cfg.write_text(variant(TINY, 'problem.name="tests.plugins.heat:Heat"', "train.max_steps=2"))
    run = tmp_path / "run"
    assert cli(["train", str(cfg), "--set", f"run.dir={run}"])[0] == 0
    monkeypatch.setattr(Heat, "input_channels", ("f", "g"))   # the plugin edited since
    with pytest.raises(ValueError) as e:
        deepfusion.load(run)
    msg = str(e.value)
    assert ("the checkpoint's network takes 1 input channel(s), but problem 'heat' now builds 2, "
            "['f', 'g']: its code changed since the network was trained") in msg
    assert "retrain" in msg and "--work-grid" not in msg and "--grid" not in msg
