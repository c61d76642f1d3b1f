"""Watching a run: the log line's step/total, elapsed time and ETA, the metrics records that
carry them, ``deepfusion status`` on a finished run, a run stopped by its time limit, a live
and then stale lock, a damaged newest checkpoint and a directory that is no run, and
``deepfusion plot`` on a run as it is. Tiny in-process runs (the ``cli`` fixture)."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from deepfusion.config import load_config
from deepfusion.engine.run import lock as runlock
from deepfusion.engine.run.eta import StepClock, eta_text, format_duration
from deepfusion.engine.train.plan import plan
from tests.in_process import deepfusion_here
from tests.mpi_util import HANG_GUARD
from tests.tiny_configs import TINY, variant

# 20 steps; validation every 2 epochs; a checkpoint every 5 steps, the newest 3 kept
WATCHED = variant(TINY, "train.eval_every_epochs=2", "train.checkpoint_every=5",
                  "train.keep_checkpoints=3")


def records(run_dir, kind):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished tiny run (once for the module): (run dir, its stdout)."""
    base = tmp_path_factory.mktemp("watched")
    (base / "tiny.toml").write_text(WATCHED)
    d = str(base / "run")
    p = deepfusion_here(["train", str(base / "tiny.toml"), "--set", f"run.dir={d}"])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return d, p.stdout


def copy_of(finished, tmp_path):
    d = str(tmp_path / "copy")
    shutil.copytree(finished[0], d)
    return d


def status_json(cli, d):
    rc, out, err = cli(["status", d, "--json"])
    assert rc == 0, err
    return json.loads(out)


# -- the log line and the records -------------------------------------------------------------

def test_the_log_line_shows_step_of_total_elapsed_and_eta(finished):
    lines = finished[1].splitlines()
    header = next(line for line in lines if line.split()[:2] == ["step", "grid"])
    assert header.split()[-2:] == ["elapsed", "eta"]
    logged = [line for line in lines if re.match(r"^\s*\d+/20\s+16x16\s", line)]
    assert [int(line.split("/")[0]) for line in logged] == [1, 5, 10, 15, 20]
    clock = r"\d+:\d\d:\d\d"
    assert all(re.search(rf"\s{clock}\s+~?{clock}$", line) for line in logged), logged
    assert logged[-1].endswith(" 0:00:00")  # nothing left after the last step


def test_step_records_carry_elapsed_segment_and_eta(finished):
    steps = records(finished[0], "step")
    assert [r["step"] for r in steps] == list(range(1, 21))
    for r in steps:
        assert r["elapsed_s"] == r["segment_s"] > 0  # one segment: the run's time is its own
        assert r["eta_s"] >= 0 and r["eta_scaled"] is False  # one level: always measured
    assert [r["elapsed_s"] for r in steps] == sorted(r["elapsed_s"] for r in steps)
    assert steps[-1]["eta_s"] == 0 and steps[0]["eta_s"] > 0


def fake_clock():
    """A clock advancing one second per reading: every step then takes 1 s of wall time."""
    ticks = iter(range(10**6))
    return lambda: float(next(ticks))


def test_the_eta_scales_levels_not_yet_run_by_grid_points_times_batch():
    """A V-cycle 32x32 (4 steps) -> 16x16 at batch 8 (4 steps) -> 32x32 (4 steps): after two
    1-second steps on 32x32, the 16x16 level is estimated at 1 s x (256 x 8)/(1024 x 4) and
    flagged; once it has run, its own median is used and nothing is estimated."""
    cfg = load_config(None, ['problem.name="burgers"', "problem.grid=[32,32]", 'train.cycle="v"',
                             "data.n_samples=16", "data.global_batch=4",
                             "train.levels=[{grid=[16,16], steps=4, global_batch=8}, "
                             "{grid=[32,32], steps=4}]"])
    visits = plan(cfg)
    assert [(v.grid, v.steps) for v in visits] == [((32, 32), 4), ((16, 16), 4), ((32, 32), 4)]
    clock = StepClock(visits, now=fake_clock())
    assert clock.eta(0) == (None, False) and eta_text(None, False) == "?"
    clock.tick(visits[0], 5.0)  # the first step of a visit: its own time (5 s)
    clock.tick(visits[0], 9.0)  # then the wall time since the previous step (1 s)
    eta, scaled = clock.eta(2)
    median = 3.0  # of 5 and 1
    assert scaled and eta == pytest.approx(2 * median + 4 * median * 0.5 + 4 * median)
    for _ in range(3):
        clock.tick(visits[1], 0.25)  # 0.25, then 1, 1
    eta, scaled = clock.eta(7)
    assert not scaled and eta == pytest.approx(1 * 1.0 + 4 * median)
    assert eta_text(eta, scaled) == "0:00:13" and eta_text(90.0, True) == "~0:01:30"
    assert format_duration(3 * 3600 + 62.4) == "3:01:02"


# -- status -------------------------------------------------------------------------------------

def test_status_of_a_finished_run(cli, finished):
    d = finished[0]
    rc, out, err = cli(["status", d])
    assert rc == 0, err
    assert "not running (finished: step 20 of 20)" in out
    assert re.search(r"step\s+20/20 \(16x16\)", out)
    assert re.search(r"validation\s+rel L2 mean [\d.]+ median [\d.]+ worst [\d.]+ at step 16", out)
    assert "step_00000020.h5 (step 20)" in out
    s = status_json(cli, d)
    assert (s["state"], s["step"], s["total_steps"], s["grid"]) == ("finished", 20, 20, [16, 16])
    assert s["problem"]["name"] == "burgers" and s["checkpoint"]["step"] == 20
    assert s["skipped_checkpoints"] == [] and s["lock"] is None
    assert s["validation"]["step"] == 16 and s["final_validation"]["n"] == 2
    last = records(d, "step")[-1]
    assert (s["loss"], s["elapsed_s"], s["eta_s"]) == (last["loss"], last["elapsed_s"], 0.0)


def test_status_of_a_run_stopped_by_its_time_limit(cli, tmp_path):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(WATCHED)
    d = str(tmp_path / "run")
    rc, _, err = cli(["train", str(cfg), "--set", f"run.dir={d}",
                      "--set", "train.time_limit_minutes=1e-9"])
    assert rc == 99, err
    s = status_json(cli, d)
    assert (s["state"], s["step"], s["checkpoint"]["step"]) == ("stopped", 1, 1)
    assert s["state_text"] == (f"not running (stopped at step 1: resume with deepfusion train "
                               f"--resume {d})")
    assert s["eta_s"] > 0 and s["validation"] is None and s["final_validation"] is None
    rc, _, err = cli(["train", "--resume", d, "--set", "train.time_limit_minutes=0"])
    assert rc == 0, err
    resumed = records(d, "step")[1:]  # the second segment's: the run's time counts the first's
    assert resumed and all(r["elapsed_s"] > r["segment_s"] > 0 for r in resumed)
    assert status_json(cli, d)["state_text"] == "not running (finished: step 20 of 20)"


def write_lock(d, pid):
    holder = runlock.Holder.here(ranks=2, command="deepfusion train x.toml")
    holder.pid, holder.pid_start, holder.slurm_job = pid, runlock.process_start(pid), "4242"
    with open(os.path.join(d, runlock.LOCK_NAME), "wb") as f:
        f.write(holder.encode())
    return holder


def test_status_of_a_live_lock_then_of_the_stale_lock_it_leaves(cli, finished, tmp_path):
    """A lock naming a live process of this machine: running; once that process has ended,
    the lock is stale, as the next train would judge it."""
    d = copy_of(finished, tmp_path)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        holder = write_lock(d, child.pid)
        s = status_json(cli, d)
        assert s["state"] == "running"
        assert re.fullmatch(rf"running \(PID {child.pid} on host {re.escape(holder.host)}, "
                            rf"Slurm job 4242, heartbeat \d+ s ago\)", s["state_text"])
        assert (s["lock"]["pid"], s["lock"]["stale"]) == (child.pid, "")
    finally:
        child.kill()
        child.wait(timeout=HANG_GUARD)
    s = status_json(cli, d)
    assert s["state"] == "stale lock" and "has ended" in s["lock"]["stale"]
    assert s["state_text"].startswith(f"stale lock (PID {child.pid} on host {holder.host}")
    assert s["state_text"].endswith("not running, finished: step 20 of 20")


def test_status_names_a_damaged_newest_checkpoint_and_uses_the_one_before(cli, finished,
                                                                          tmp_path):
    d = copy_of(finished, tmp_path)
    newest = os.path.join(d, "checkpoints", "step_00000020.h5")
    with open(newest, "r+b") as f:  # one flipped byte in the middle of the data
        f.seek(os.path.getsize(newest) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    rc, out, err = cli(["status", d])
    assert rc == 0, err
    assert re.search(r"checkpoint\s+\S+step_00000015\.h5 \(step 15\)", out)
    assert re.search(r"skipped\s+step_00000020\.h5: corrupt checkpoint", out)
    assert (f"not running (stopped at step 20: resume with deepfusion train --resume {d} (it "
            f"continues from step 15, the newest complete checkpoint))") in out


@pytest.mark.parametrize("what", ["missing", "empty", "file"])
def test_status_and_plot_refuse_what_is_not_a_run_directory(cli, tmp_path, what):
    d = tmp_path / "x"
    if what == "empty":
        d.mkdir()
    elif what == "file":
        d.write_text("not a run")
    for cmd in (["status", str(d)], ["plot", str(d)]):
        rc, out, err = cli(cmd)
        assert rc == 2 and out == ""
        assert f"'{d}' is not a " in err and "run.dir" in err


# -- plot ---------------------------------------------------------------------------------------

def test_plot_draws_a_run_as_it_is_next_to_the_runs_own_figure(cli, finished, tmp_path):
    d = copy_of(finished, tmp_path)
    with open(os.path.join(d, "metrics.jsonl"), "a") as f:
        f.write('{"kind": "step", "step": 21, "lo')  # a line the job is still writing
    rc, out, err = cli(["plot", d])
    assert rc == 0, err
    png = os.path.join(d, "progress.png")
    assert out.startswith(f"{png}: loss and validation curves of {d} to step 20/20")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert not os.path.exists(os.path.join(d, "loss.png"))  # never the run's own figure
    assert status_json(cli, d)["step"] == 20  # the partial line is skipped there too
    rc, _, err = cli(["plot", d, "--out", str(tmp_path / "curves.txt")])
    assert rc == 2 and "give a file ending in .png" in err


def test_plot_of_a_run_without_steps_says_so(cli, tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / "metrics.jsonl").write_text("")
    rc, _, err = cli(["plot", str(d)])
    assert rc == 2 and "holds no step yet" in err
