"""A multigrid plan cut by train.max_steps: the network last trained on a coarser level than
problem.grid, so the end-of-training validation, the checkpoint, ``evaluate``, ``infer
--work-grid trained`` and ``status`` all speak of the last grid trained, and say which.
Tiny: Poisson 16x16 -> 32x32, cut after 3 steps of the 16x16 level, one process."""
import json
import os

import h5py
import pytest

from deepfusion.engine.predict.loader import load_model, training_grid
from deepfusion.engine.checkpoint.store import latest_checkpoint
from tests.test_engine_mpi import train
from tests.tiny_configs import TINY, variant

CUT = variant(TINY, 'problem.name="poisson"', "problem.grid=[32, 32]", "train.max_steps=3",
              "train.levels=[{grid = [16, 16], steps = 4}, {grid = [32, 32], steps = 4}]",
              drop=("train.epochs",))


@pytest.fixture(scope="module")
def cut(tmp_path_factory):
    """(run dir, train's stdout, its stderr) of the cut run."""
    d = tmp_path_factory.mktemp("cut")
    (d / "cut.toml").write_text(CUT)
    run = str(d / "run")
    p = train(0, str(d / "cut.toml"), run)
    assert p.returncode == 0, p.stderr[-3000:]
    return run, p.stdout, p.stderr


def test_the_final_validation_is_on_the_last_grid_trained_and_says_so(cut):
    run, out, err = cut
    with open(os.path.join(run, "eval.json")) as f:
        s = json.load(f)
    assert (s["grid"], s["step"], s["level"]) == ([16, 16], 3, 0)
    assert "validation relative L2 over 2 draws (data.eval_seed) on 16x16 at step 3" in out
    assert "ended the plan in level 0: validated on 16x16, the last grid trained, not " \
        "problem.grid 32x32" in err, err


def test_the_checkpoint_evaluate_and_infer_use_the_last_grid_trained(cut, cli, tmp_path):
    run = cut[0]
    path = latest_checkpoint(run)
    _model, problem, _work, meta = load_model(path)
    assert training_grid(meta) == [16, 16] and list(problem.grid) == [16, 16]
    # evaluate on the validation draw gives eval.json's numbers: the same grid, the same network
    rc, out, _ = cli(["evaluate", run, "--seed", "12345", "--samples", "2",
                      "--out", str(tmp_path / "e.json")])
    assert rc == 0 and "on 16x16" in out, out
    e = json.loads((tmp_path / "e.json").read_text())
    with open(os.path.join(run, "eval.json")) as f:
        assert e["rel_l2"] == pytest.approx(json.load(f)["rel_l2"], rel=1e-6)
    assert e["grid"] == [16, 16]
    p = str(tmp_path / "p.h5")
    assert cli(["infer", run, "--samples", "1", "--grid", "32x32", "--out", p])[0] == 0
    with h5py.File(p) as f:
        assert list(f.attrs["work_grid"]) == [16, 16]


def test_status_reports_the_final_validation_with_its_grid(cut, cli):
    run = cut[0]
    rc, out, _ = cli(["status", run, "--json"])
    assert rc == 0
    final = json.loads(out)["final_validation"]
    assert (final["grid"], final["step"]) == ([16, 16], 3)
