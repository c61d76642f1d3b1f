"""Failures that cannot lose a run, tried with real processes as a demanding user would:
rollbacks that lower the rate until a floor, kill -9 of one rank, checkpoints by time, a
refused launch that leaves nothing behind, bad grids refused up front, a resume without a
checkpoint, a changed train.max_steps on resume. Timeouts are hang guards only."""
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.faults.steps import fault_env
from tests.in_process import deepfusion_here
from tests.mpi_util import HANG_GUARD, ROOT, deepfusion, mpiexec, run_mpi
from deepfusion.engine.checkpoint.store import latest_checkpoint
from tests.test_engine_mpi import losses, tiny, train  # noqa: F401 (tiny: a fixture)
from tests.tiny_configs import TINY
from tests.tiny_runs import trained

pytestmark = pytest.mark.mpi


def records(run_dir, kind=None):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return [r for r in recs if kind is None or r["kind"] == kind]


def checkpoints(run_dir):
    return sorted(n for n in os.listdir(os.path.join(run_dir, "checkpoints")) if n.endswith(".h5"))


@pytest.mark.full
def test_rollback_lowers_the_rate_until_the_floor_then_stops_with_exit_3(tiny, tmp_path):
    """A failure that recurs before the next checkpoint: every rollback to the same checkpoint
    halves the rate again; below train.rollback_min_lr_scale the run stops (exit 3). No failed
    step is logged, and no checkpoint is written under a step that was not taken."""
    d = str(tmp_path / "r")
    p = train(2, tiny, d, "optim.name=\"sgd\"", "optim.lr=1e12", "train.dtype=\"float32\"",
              "train.on_nonfinite=\"rollback\"", "train.checkpoint_every=1",
              "train.keep_checkpoints=5")
    assert p.returncode == 3, p.stderr
    rolls = records(d, "rollback")
    # 0.5^k for k = 1..9 stays above the floor 1e-3; 0.5^10 does not: stop
    assert [r["lr_scale"] for r in rolls] == pytest.approx([0.5 ** k for k in range(1, 10)])
    assert [r["rollbacks"] for r in rolls] == list(range(1, 10))
    assert len({r["step"] for r in rolls}) == 1  # always back to the same checkpoint
    assert p.stderr.count("rolled back to") == 9  # printed once (rank 0), not once per rank
    assert "still failing after 9 rollback(s)" in p.stderr and "rollback_min_lr_scale" in p.stderr
    steps = [r["step"] for r in records(d, "step")]
    assert steps == list(range(1, len(steps) + 1))  # no failed step, no gap
    assert checkpoints(d) == [f"step_{s:08d}.h5" for s in range(0, len(steps) + 1)]


def test_transient_nan_rolls_back_once_and_finishes(tiny, tmp_path, tmp_path_factory):
    """A NaN at step 7 (injected once): back to the step-4 checkpoint at half the rate, then
    the run finishes; the steps before the checkpoint are those of the uninterrupted run."""
    full, d = trained(tmp_path_factory, TINY, 2), str(tmp_path / "r")
    p = train(2, tiny, d, "train.on_nonfinite=\"rollback\"", "train.checkpoint_every=4",
              env=fault_env("nan@7"))
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("rolled back to step_00000004.h5") == 1
    steps = records(d, "step")
    assert [r["step"] for r in steps] == list(range(1, 21))
    assert losses(d)[:4] == losses(full)[:4]
    assert [r["lr"] for r in steps[:4]] == [3e-3] * 4
    assert [r["lr"] for r in steps[4:]] == pytest.approx([1.5e-3] * 16)
    assert records(d, "rollback")[0]["failed_at"] == 7


def _rank_pids(run_dir):
    """PIDs of the python ranks whose command line names ``run_dir``."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if any(run_dir.encode() in c for c in cmd) and b"deepfusion" in cmd and \
                    os.path.basename(cmd[0].decode()).startswith("python"):
                out.append(int(pid))
    return sorted(out)


@pytest.mark.full
def test_kill_9_of_one_rank_ends_the_job_and_the_newest_checkpoint_resumes(tiny, tmp_path):
    d = str(tmp_path / "k")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "deepfusion", "train", tiny,
           "--set", f"run.dir={d}", "--set", "train.epochs=1000", "--set", "train.checkpoint_every=5"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT)
    deadline = time.monotonic() + HANG_GUARD
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.isdir(os.path.join(d, "checkpoints")) and checkpoints(d):
            break
        time.sleep(0.2)
    pids = _rank_pids(d)
    assert len(pids) == 2, pids
    t0 = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    # the bound for noticing a dead rank (measured: 0.1 s with MPICH's mpiexec)
    proc.communicate(timeout=30)
    took = time.monotonic() - t0
    assert proc.returncode != 0
    print(f"job ended {took:.1f} s after kill -9 of one rank, exit {proc.returncode}")
    newest = os.path.basename(latest_checkpoint(d))
    p = deepfusion(2, ["train", "--resume", d, "--set", f"train.max_steps={int(newest[5:13]) + 3}"])
    assert p.returncode == 0, p.stderr
    assert "resumed from" in p.stdout and newest in p.stdout


@pytest.mark.full
def test_checkpoints_by_time_are_agreed_by_all_ranks(tiny, tmp_path):
    """train.checkpoint_minutes tiny and no checkpoint_every: rank 0's clock says "due"; the
    request travels in the fused allreduce, so both ranks save at the same steps (a
    disagreement would leave one rank in the checkpoint barrier: a hang, caught by the guard)."""
    d = str(tmp_path / "t")
    p = train(2, tiny, d, "train.checkpoint_minutes=1e-9", "train.keep_checkpoints=100",
              "train.max_steps=6")
    assert p.returncode == 0, p.stderr
    saved = checkpoints(d)
    assert saved[0] == "step_00000001.h5" and saved[-1] == "step_00000006.h5"
    p = train(2, tiny, str(tmp_path / "off"), "train.checkpoint_minutes=0", "train.max_steps=6")
    assert p.returncode == 0 and checkpoints(str(tmp_path / "off")) == ["step_00000006.h5"]


def test_a_refused_launch_creates_nothing(tiny, tmp_path):
    """...and exits before any rank imports torch (-X importtime lists every import)."""
    d = tmp_path / "fresh"
    p = run_mpi(2, ["-X", "importtime", "-m", "deepfusion", "train", tiny, "--set",
                    f"run.dir={d}", "--set", "data.global_batch=5", "--set", "data.n_samples=20"])
    assert p.returncode == 2 and "not divisible" in p.stderr
    imported = re.findall(r"\|\s+([\w.]+)$", p.stderr, flags=re.M)  # both ranks' import lists
    assert "mpi4py.MPI" in imported and "torch" not in imported
    assert not d.exists()  # so the corrected command is not refused as "already holds a run"
    p = train(2, tiny, str(d), "data.global_batch=6", "data.n_samples=24", "train.max_steps=2")
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("sets,needle", [
    (["model.options={depth=9, base_width=4}", "problem.grid=[32,32]"], "not divisible by 2**depth"),
    (["problem.name=\"no_such_pde\""], "unknown problem 'no_such_pde'"),
])
def test_bad_model_or_problem_refused_up_front(tiny, tmp_path, sets, needle):
    d = tmp_path / "bad"
    p = train(2, tiny, str(d), *sets)
    assert p.returncode == 2, p.stderr
    assert needle in p.stderr and p.stderr.count("deepfusion: error") == 1
    assert "Traceback" not in p.stderr and not d.exists()


def test_resume_without_a_loadable_checkpoint_is_bad_input(tiny, tmp_path):
    d = tmp_path / "empty"
    (d / "checkpoints").mkdir(parents=True)
    (d / "metrics.jsonl").write_text("")
    (d / "checkpoints" / "step_00000004.h5").write_bytes(b"not hdf5")
    p = deepfusion(2, ["train", tiny, "--resume", str(d)])
    assert p.returncode == 2, p.stderr
    assert "no loadable checkpoint" in p.stderr and "step_00000004.h5" in p.stderr
    assert p.stderr.count("deepfusion: error") == 1 and "Traceback" not in p.stderr


def test_max_steps_changed_on_resume_replans_the_schedule_and_says_so(tiny, tmp_path):
    """A resume that moves the end of the run re-plans the learning-rate schedule from the
    checkpoint's step, continuing it: the rate at the step is the one the old plan had there,
    and the cosine reaches optim.min_lr (0) on the new last step, not the old one. One log
    line and a metrics record say so."""
    d = str(tmp_path / "cut")
    p = train(None, tiny, d, "optim.schedule=\"cosine\"", "train.max_steps=8",
              "train.checkpoint_every=4", "train.keep_checkpoints=5")
    assert p.returncode == 0, p.stderr
    os.remove(os.path.join(d, "checkpoints", "step_00000008.h5"))  # resume from step 4
    p = deepfusion_here(["train", "--resume", d, "--set", "train.max_steps=12"])
    assert p.returncode == 0, p.stderr
    assert "train.max_steps 8 -> 12: the learning-rate schedule, planned to end after 8 " \
           "steps, is re-planned to end after 12" in p.stdout
    lr = [r["lr"] for r in records(d, "step")]
    assert len(lr) == 12
    assert lr[:4] == pytest.approx([1.5e-3 * (1 + math.cos(math.pi * s / 8)) for s in range(4)])
    # from step 4 the 8-step cosine's remaining half (4 -> 8) runs over the 8 steps left
    v = [4 + (s - 4) * (8 - 4) / (12 - 4) for s in range(4, 12)]
    assert lr[4:] == pytest.approx([1.5e-3 * (1 + math.cos(math.pi * x / 8)) for x in v])
    (rec,) = records(d, "replan")
    assert rec["step"] == 4 and rec["end"] == 12 and rec["schedule_warp"] == [4, 4.0, 12]
