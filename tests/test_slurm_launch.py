"""``deepfusion launch`` with ``srun`` under a real Slurm: srun answers SIGHUP (a closed
terminal) and SIGTERM by SIGKILLing its tasks, which never hear a signal they could catch; under
``deepfusion launch --launcher 'srun --mpi=pmi2'`` a hang-up stops every rank with a checkpoint
(exit 99). `make test-slurm` starts the cluster; without one every test here is skipped. Waits
are hang guards, never assertions about speed."""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slurm_local.client import ENV_PARTITION, ENV_WORKDIR, cluster_up
from tests.test_runlock import steps, wait_for_steps
from tests.tiny_configs import TINY

pytestmark = [pytest.mark.slurm,
              pytest.mark.skipif(not cluster_up(), reason="needs a Slurm cluster: `make test-slurm` starts one")]

ROOT = Path(__file__).resolve().parents[1]
HANG_GUARD = 600
RECORDS = r"""
import os, signal, sys, time
def on(sig, frame):
    open(sys.argv[1] + os.environ["SLURM_PROCID"], "w").write(signal.Signals(sig).name); sys.exit(0)
for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, on)
open(sys.argv[1] + os.environ["SLURM_PROCID"], "w").write("ready")
time.sleep(600)
"""


@pytest.fixture
def work(request) -> Path:
    """A fresh directory the cluster's nodes see."""
    d = Path(os.environ[ENV_WORKDIR]) / f"launch-{os.getpid()}-{request.node.name}"
    d.mkdir(parents=True)
    return d


def srun(*more: str) -> list[str]:
    part = os.environ.get(ENV_PARTITION, "")
    return ["srun", *(["-p", part] if part else []), *more]


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    e.pop("DEEPFUSION_NO_MPI", None)
    return e


def in_background(argv):
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env(), cwd=ROOT, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM], ids=["HUP", "TERM"])
def test_srun_kills_its_tasks_on_a_hangup_or_term(work, sig):
    (work / "rec.py").write_text(RECORDS)
    rec = str(work / "rank")
    job = in_background(srun("-n", "2", sys.executable, str(work / "rec.py"), rec))
    try:
        until = time.monotonic() + HANG_GUARD
        while not all(Path(rec + str(r)).exists() and Path(rec + str(r)).read_text() == "ready"
                      for r in range(2)):
            assert job.poll() is None and time.monotonic() < until, job.communicate()[1]
            time.sleep(0.1)
        job.send_signal(sig)
        job.communicate(timeout=HANG_GUARD)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    assert [Path(rec + str(r)).read_text() for r in range(2)] == ["ready", "ready"]  # no signal


def test_a_hangup_to_deepfusion_launch_with_srun_checkpoints_and_exits_99(work):
    cfg, d = work / "tiny.toml", str(work / "run")
    cfg.write_text(TINY)
    launcher = shlex.join(srun("--mpi=pmi2"))
    job = in_background([sys.executable, "-m", "deepfusion", "launch", "--launcher", launcher,
                         "-n", "2", "--", "train", str(cfg), "--set", f"run.dir={d}", "--set",
                         "train.epochs=100000", "--set", "train.checkpoint_every=100000"])
    try:
        wait_for_steps(d, job, n=1)
        job.send_signal(signal.SIGHUP)
        _, err = job.communicate(timeout=HANG_GUARD)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 99, err[-3000:]
    assert "deepfusion launch: SIGHUP (the terminal or ssh session closed): SIGUSR1 to srun" in err
    assert "checkpoint written at step" in err and steps(d)
    assert any(n.endswith(".h5") for n in os.listdir(os.path.join(d, "checkpoints")))
