"""Stop signals that always stop (deepfusion.engine.run.stop, .watchdog): the first SIGTERM asks
for a checkpoint, its copies change nothing, and a rank stuck in native code with the GIL held
(DEEPFUSION_FAULT=hang@S) still ends on a second SIGTERM or at the deadline; a rank whose peers
never join MPI_Init ends with a message. The watchdog's rules in-process, then real processes.
Timeouts are hang guards only."""
import os
import signal
import subprocess
import sys
import time

import pytest

from deepfusion.engine.run import watchdog
from deepfusion.engine.run.watchdog import DUP_S, START, STARTED, Watch
from tests.faults.steps import fault_env
from tests.mpi_util import HANG_GUARD, ROOT, mpiexec
from tests.test_runlock import start, steps, tiny, wait_for_steps  # noqa: F401 (tiny: fixture)

TERM, USR1 = signal.SIGTERM, signal.SIGUSR1


def test_copies_of_the_first_signal_change_nothing_a_later_term_ends():
    w = Watch(deadline=60, start=0)
    assert w.feed(TERM, 0.0) == "" and w.feed(TERM, 0.1) == "" and w.feed(USR1, DUP_S) == ""
    assert "a second SIGTERM" in w.feed(TERM, DUP_S + 0.5)


def test_the_deadline_counts_from_the_first_term_and_usr1_starts_none():
    w = Watch(deadline=60, start=0)
    w.feed(USR1, 0.0)  # Slurm's warning: the time limit's own TERM follows
    assert w.due(1000.0) == ""
    w.feed(TERM, 2.0)  # within DUP_S of the USR1: the first TERM, not a second signal
    assert w.due(61.0) == "" and "still running 60 s after SIGTERM" in w.due(62.0)
    assert Watch(deadline=0, start=0).feed(TERM, 0.0) == ""  # 0: no deadline
    w0 = Watch(deadline=0, start=0)
    w0.feed(TERM, 0.0)
    assert w0.due(1e9) == ""


def test_the_wait_in_mpi_init_is_bounded_and_ends_when_mpi_is_up():
    w = Watch(deadline=60, start=30)
    w.feed(START, 0.0)
    assert w.due(29.0) == "" and "waited 30 s at start-up (MPI_Init" in w.due(30.0)
    w.feed(STARTED, 29.0)
    assert w.due(1000.0) == ""
    assert 0 < w.wait_s(0.0) <= watchdog.POLL_S


def test_a_malformed_setting_is_bad_input(tmp_path, monkeypatch, cli):
    monkeypatch.setenv("DEEPFUSION_STOP_DEADLINE", "soon")
    rc, _, err = cli(["train", str(tmp_path / "none.toml")])
    assert rc == 2 and "DEEPFUSION_STOP_DEADLINE='soon': give a number of seconds" in err


def run_env(**extra):
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", **extra)


@pytest.mark.mpi
def test_a_term_and_its_copies_still_checkpoint_and_exit_99(tiny, tmp_path):
    """Under Slurm one scancel reaches a rank several times at once (directly, from the job
    script's trap, from the launcher): a healthy run still stops with a checkpoint."""
    d = str(tmp_path / "copies")
    job = start(0, tiny, d, "train.epochs=100000")
    wait_for_steps(d, job)
    for _ in range(3):
        job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=HANG_GUARD)
    assert job.returncode == 99 and "checkpoint written at step" in err, err


@pytest.mark.mpi
@pytest.mark.full
def test_a_second_term_ends_a_rank_stuck_in_native_code(tiny, tmp_path):
    d = str(tmp_path / "stuck")
    job = start(0, tiny, d, "train.epochs=100000", env=fault_env("hang@3"))
    wait_for_steps(d, job, n=2)
    job.send_signal(signal.SIGTERM)
    time.sleep(DUP_S + 1.0)  # a later signal, not a copy of the first
    assert job.poll() is None  # the first TERM only asked for a checkpoint it never reaches
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=HANG_GUARD)
    assert job.returncode == -signal.SIGKILL, err
    assert "a second SIGTERM" in err and "without a checkpoint" in err, err
    assert "in hang_in_native_code" in err  # where it was stuck: its Python stack
    assert steps(d) == [1, 2]


@pytest.mark.mpi
def test_the_deadline_ends_every_rank_when_one_is_stuck(tiny, tmp_path):
    """Rank 1 stuck in C, rank 0 waiting for it in the step's allreduce: one TERM to the
    launcher (timeout's, Slurm's) ends the whole job at the deadline."""
    d = str(tmp_path / "deadline")
    job = start(2, tiny, d, "train.epochs=100000",
                env={**fault_env("hang@3:1"), "DEEPFUSION_STOP_DEADLINE": "2"})
    wait_for_steps(d, job, n=2)
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=HANG_GUARD)
    assert job.returncode not in (0, 99), err
    assert "rank 1 (PID" in err and "still running 2 s after SIGTERM" in err, err


@pytest.mark.mpi
@pytest.mark.parametrize("peer", [
    ["false"],  # never calls MPI_Init
    ["env", "DEEPFUSION_NO_MPI=1", "SELF"],  # deepfusion without MPI: a world of its own
    [sys.executable, "-c", "from mpi4py import MPI; import time; time.sleep(600)"],  # joins MPI,
])                                                    # never the first exchange
def test_a_rank_whose_peers_never_join_mpi_ends_with_a_message(tiny, tmp_path, peer):
    """An MPMD launch where the other process never calls MPI_Init (MPICH's MPI_Init waits for
    it forever: pmodels/mpich#6124, wontfix), or joins MPI but runs another program: the
    watchdog ends the rank with the reason, and the launcher the rest."""
    d = str(tmp_path / "mpmd")
    me = [sys.executable, "-m", "deepfusion", "train", tiny, "--set", f"run.dir={d}"]
    other = [a for p in peer for a in (me if p == "SELF" else [p])]
    cmd = [mpiexec(), "-n", "1"] + me + [":", "-n", "1"] + other
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=HANG_GUARD,
                       env=run_env(DEEPFUSION_START_TIMEOUT="2"))
    assert p.returncode != 0
    assert "rank 0 (PID" in p.stderr, p.stderr
    assert "waited 2 s at start-up (MPI_Init, the first exchange) for the other" in p.stderr
    assert "launch every rank with the same deepfusion command" in p.stderr
    assert not os.path.exists(d)  # nothing was started
