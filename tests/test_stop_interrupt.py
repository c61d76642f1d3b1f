"""Ctrl-C (SIGINT) and a closed terminal (SIGHUP) stop a training run as SIGTERM does: every rank
stops after the same step, writes a checkpoint and exits 99, whether the signal reaches the
launcher (SIGINT: MPICH's mpiexec forwards it) or one rank (SIGHUP: a launcher that forwards it,
or the rank's own terminal; MPICH's mpiexec itself dies of a SIGHUP, see docs/run-directory.md).
The watchdog counts them as SIGTERM. Timeouts are hang guards only."""
import json
import os
import signal

import pytest

from deepfusion.engine.run.watchdog import DUP_S, Watch
from tests.mpi_util import HANG_GUARD
from tests.test_runlock import start, tiny, wait_for_steps  # noqa: F401 (tiny: fixture)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP])
def test_the_watchdog_counts_interrupt_and_hangup_as_term(sig):
    w = Watch(deadline=60, start=0)
    assert w.feed(sig, 0.0) == ""
    assert w.due(59.0) == "" and "still running 60 s after SIGTERM" in w.due(61.0)
    again = Watch(deadline=0, start=0)
    assert again.feed(sig, 0.0) == "" and again.feed(sig, 0.1) == ""     # copies of one request
    assert "a second SIGTERM" in again.feed(sig, DUP_S + 1.0)


def checkpointed(run_dir):
    names = os.listdir(os.path.join(run_dir, "checkpoints"))
    return [n for n in names if n.startswith("step_") and n.endswith(".h5")]


@pytest.mark.mpi
@pytest.mark.parametrize("sig,to", [(signal.SIGINT, "launcher"), (signal.SIGINT, "rank"),
                                    (signal.SIGHUP, "rank")])
def test_an_interrupt_or_hangup_checkpoints_and_exits_99(tiny, tmp_path, sig, to):
    d = str(tmp_path / "run")
    # a job started with SIGHUP ignored (these tests run under nohup) keeps ignoring it, as
    # nohup asks: not the case tested here
    kept = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        job = start(2, tiny, d, "train.epochs=100000", "train.checkpoint_every=100000")
    finally:
        signal.signal(signal.SIGHUP, kept)
    try:
        wait_for_steps(d, job)
        if to == "launcher":
            job.send_signal(sig)
        else:   # one rank alone (kill -INT PID): the step's agreement stops them all
            with open(os.path.join(d, "lock.json")) as f:
                os.kill(json.load(f)["pid"], sig)
        _, err = job.communicate(timeout=HANG_GUARD)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 99, err[-3000:]
    assert "checkpoint written at step" in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert checkpointed(d)
