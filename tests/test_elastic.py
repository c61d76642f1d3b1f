"""Resume: a run checkpointed on P = 2 ranks continues bit for bit on P = 2 and, elastically,
on P = 1 and 4 with the losses of the uninterrupted run (float64), across the Adam -> L-BFGS
switch too; a P that does not divide data.global_batch is refused with the nearest valid
ones. Real mpiexec processes; -n 4 is oversubscribed on 2 cores, so everything is tiny."""
import json
import os
import shutil

import pytest

from deepfusion.engine.checkpoint import store as ckpt
from tests.faults.steps import fault_env
from tests.mpi_util import deepfusion
from tests.test_engine_mpi import losses, tiny, train  # noqa: F401 (tiny: a fixture)
from tests.test_lbfgs import SWITCH
from tests.tiny_configs import TINY
from tests.tiny_runs import trained

pytestmark = pytest.mark.mpi


def _cut(config, run_dir, every, fail_at, *sets):
    """A P=2 run killed by an exception on rank 1 at step ``fail_at`` (checkpoints every
    ``every`` steps)."""
    p = train(2, config, run_dir, f"train.checkpoint_every={every}", *sets,
              env=fault_env(f"raise@{fail_at}:1"))
    assert p.returncode != 0 and f"injected failure at step {fail_at} on rank 1" in p.stderr


def _copies(cut, ranks=(1, 4)) -> dict:
    """Copies of the cut run directory, one per P to resume on (before any resume touches it)."""
    out = {}
    for n in ranks:
        out[n] = f"{cut}_p{n}"
        shutil.copytree(cut, out[n])
    return out


def _resume_on(n, d, where, want):
    p = deepfusion(n, ["train", "--resume", d])
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"checkpoint written on P = 2 ranks, continuing on P = {max(n, 1)}" in p.stdout
    assert where in p.stdout
    got = losses(d)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a == pytest.approx(b, rel=1e-9, abs=0), (n, got, want)


@pytest.mark.full
def test_p2_checkpoint_resumes_bit_for_bit_on_p2_and_on_the_same_trajectory_on_p1_p4(
        tiny, tmp_path, tmp_path_factory):
    full, cut = trained(tmp_path_factory, TINY, 2), str(tmp_path / "cut")
    _cut(tiny, cut, 8, 14)
    elsewhere = _copies(cut)
    p = deepfusion(2, ["train", "--resume", cut])
    assert p.returncode == 0, p.stderr
    assert "resumed from" in p.stdout and "step_00000008" in p.stdout
    assert losses(cut) == losses(full)  # bit-for-bit: same P, same threads, same order
    for n, d in elsewhere.items():
        _resume_on(n, d, "step_00000008", losses(full))


def _steps(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == "step"]


@pytest.mark.full
def test_adam_then_lbfgs_resumes_across_the_switch_on_p2_and_elsewhere(tmp_path):
    """Adam for 4 steps, then L-BFGS: killed after the Adam checkpoint (step 3), then after the
    L-BFGS one (step 6, which holds an L-BFGS history); the resumes continue bit for bit on
    P = 2 and on the same trajectory on P = 1 and 4."""
    cfg = tmp_path / "sw.toml"
    cfg.write_text(SWITCH)
    full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
    p = train(2, str(cfg), full)
    assert p.returncode == 0, p.stderr[-3000:]
    steps = _steps(full)
    assert [r.get("optimizer", "adam") for r in steps] == ["adam"] * 4 + ["lbfgs"] * 6
    assert all(r["func_evals"] >= 1 and r["lr"] == 1.0 for r in steps[4:])
    assert steps[-1]["loss"] < steps[4]["loss"] < steps[0]["loss"]
    _cut(str(cfg), cut, 3, 6)
    p = deepfusion(2, ["train", "--resume", cut], env=fault_env("raise@9:1"))
    assert p.returncode != 0 and "step_00000003" in p.stdout
    st = ckpt.load_checkpoint(os.path.join(cut, "checkpoints", "step_00000006.h5"))
    assert st["meta"]["optimizer"] == "lbfgs" and st["optim_state"]["state"][0]["old_dirs"]
    elsewhere = _copies(cut)
    p = deepfusion(2, ["train", "--resume", cut])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "step_00000006" in p.stdout
    assert [r["loss"] for r in _steps(cut)] == [r["loss"] for r in steps]  # bit-for-bit
    for n, d in elsewhere.items():
        _resume_on(n, d, "step_00000006", [r["loss"] for r in steps])


def test_a_p_that_does_not_divide_the_batch_is_refused_with_the_nearest_valid_ones(tiny, tmp_path):
    cut = str(tmp_path / "cut")
    _cut(tiny, cut, 8, 10)
    p = deepfusion(3, ["train", "--resume", cut])
    assert p.returncode == 2
    assert "not divisible by the number of ranks P = 3" in p.stderr
    assert "Run on P = 2 or 4 ranks" in p.stderr and p.stderr.count("deepfusion: error") == 1
