"""Start-up: a launcher that started several processes which MPI sees as separate worlds of 1
is refused before anything is built (exit 2, the fix named); a stop signal that arrives while
the train command is still loading is kept for the first step (checkpoint, exit 99)."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from deepfusion.engine.parallel.comm import SerialComm, launcher_mismatch
from tests.mpi_util import HANG_GUARD, ROOT, deepfusion
from tests.tiny_configs import TINY


def test_launcher_sizes_against_a_world_of_one():
    comm = SerialComm()
    assert launcher_mismatch(comm, {}) is None
    assert launcher_mismatch(comm, {"SLURM_STEP_NUM_TASKS": "1", "PMI_SIZE": "1"}) is None
    msg = launcher_mismatch(comm, {"SLURM_STEP_NUM_TASKS": "4"})
    assert "srun started 4 processes" in msg and "--mpi=pmi2" in msg
    assert "Open MPI" in launcher_mismatch(comm, {"OMPI_COMM_WORLD_SIZE": "2"})
    assert launcher_mismatch(comm, {"PMI_SIZE": "x"}) is None


@pytest.mark.mpi
def test_a_singleton_under_a_multi_task_launcher_is_refused(tmp_path):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=ROOT, SLURM_STEP_NUM_TASKS="2")
    p = subprocess.run([sys.executable, "-m", "deepfusion", "train", str(cfg), "--set",
                        f"run.dir={run}"], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=HANG_GUARD)
    assert p.returncode == 2, p.stderr
    assert "srun started 2 processes (SLURM_STEP_NUM_TASKS=2)" in p.stderr
    assert not run.exists()


@pytest.mark.mpi
def test_a_stop_signal_during_start_up_is_neither_fatal_nor_lost(tmp_path):
    """SIGUSR1 as soon as the run directory exists, during start-up (the default action would
    kill the rank; the handler is in from the start of the train command): not fatal, not lost,
    the run stops with a checkpoint at the next step boundary and resumes. Which step that is
    depends on how far start-up got (a tiny run's first step takes milliseconds)."""
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "deepfusion", "train", str(cfg), "--set",
                             f"run.dir={run}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=ROOT)
    deadline = time.monotonic() + HANG_GUARD  # hang guard only
    while not (run / "config.toml").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # the run directory exists: the handlers are in, training not begun
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=HANG_GUARD)
    assert proc.returncode == 99, err
    stopped = re.search(r"checkpoint written at step (\d+)", err)
    assert stopped and 1 <= int(stopped.group(1)) < 20, err     # TINY runs 20 steps
    p = deepfusion(0, ["train", "--resume", str(run)])
    assert p.returncode == 0, p.stderr
