"""``deepfusion launch`` (deepfusion.app.launch, deepfusion.engine.run.keeper): a closed terminal,
Ctrl-C or SIGTERM stops every rank with a checkpoint (exit 99) instead of killing them without
one. The launcher runs in a session of its own, every stop signal reaches it as the SIGUSR1 it
passes on to every rank, and SIGTERM then SIGKILL follow when it does not end. The rules
in-process; then real processes: a stand-in launcher that records what reaches it (fast), and
real training under the venv's mpiexec (``full``). Timeouts are hang guards only."""
from __future__ import annotations

import json
import os
import pty
import select
import shlex
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from deepfusion.app.launch import GRACE_S, LAUNCHER_ENV, launch_argv
from deepfusion.engine.checkpoint.store import seal_status
from deepfusion.engine.run import keeper
from deepfusion.engine.run.keeper import DUP_S, Ladder
from tests.mpi_util import HANG_GUARD, ROOT
from tests.test_runlock import steps, tiny, wait_for_steps  # noqa: F401 (tiny: fixture)

HUP, INT, TERM, USR1, KILL = (signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGUSR1,
                              signal.SIGKILL)


def test_the_first_stop_signal_asks_every_rank_for_a_checkpoint_its_copies_nothing():
    lad = Ladder(grace=100)
    first = lad.heard(HUP, 0.0)
    assert first.send == USR1 and "SIGHUP (the terminal or ssh session closed)" in first.why
    assert "checkpoint and exits 99" in first.why and "--resume" in first.why
    assert lad.heard(HUP, 0.1) is None and lad.heard(INT, 0.2) is None  # copies
    assert lad.heard(HUP, 50.0) is None and lad.heard(USR1, 60.0) is None  # never harder
    assert lad.due(99.0) is None and 0 < lad.wait_s(99.5) <= 1.0


def test_a_second_interrupt_or_term_ends_the_ranks_then_the_launcher():
    lad = Ladder(grace=100)
    assert lad.heard(INT, 0.0).send == USR1
    second = lad.heard(INT, DUP_S + 1)
    assert second.send == TERM and "without a checkpoint" in second.why
    assert lad.heard(TERM, DUP_S + 2) is None  # a copy of the second
    third = lad.heard(TERM, 2 * DUP_S + 3)
    assert third.send == KILL and "its ranks end with it" in third.why
    assert lad.heard(INT, 1000.0) is None and lad.due(1e9) is None  # nothing after SIGKILL


def test_a_launcher_that_does_not_end_gets_term_then_kill_after_the_grace():
    lad = Ladder(grace=30)
    lad.heard(TERM, 0.0)
    assert lad.due(29.0) is None
    term = lad.due(30.0)
    assert term.send == TERM and "still running 30 s after SIGUSR1" in term.why
    assert lad.due(59.0) is None
    kill = lad.due(60.0)
    assert kill.send == KILL and "still running 30 s after SIGTERM" in kill.why
    assert Ladder(grace=30).due(1e9) is None  # no signal heard: nothing is due


def args(command, ranks=2, launcher=None, grace=GRACE_S):
    return SimpleNamespace(command=command, ranks=ranks, launcher=launcher, grace=grace)


def test_the_launcher_command_line():
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    rank = [sys.executable, "-m", "deepfusion", "train", "c.toml"]
    if os.access(beside, os.X_OK):  # the venv's MPICH comes first
        assert launch_argv(args(["--", "train", "c.toml"]), {}) == [beside, "-n", "2"] + rank
    env = {LAUNCHER_ENV: "srun --mpi=pmi2"}
    assert launch_argv(args(["train", "c.toml"], ranks=None), env) == ["srun", "--mpi=pmi2"] + rank
    given = args(["train", "c.toml"], launcher="mpirun --bind-to core")
    assert launch_argv(given, env)[:5] == ["mpirun", "--bind-to", "core", "-n", "2"]


@pytest.mark.parametrize("command,change,says", [
    ([], {}, "give the deepfusion command after --, e.g. deepfusion launch -n 2 -- train"),
    (["--"], {}, "give the deepfusion command after --"),
    (["launch", "train"], {}, "not another launch"),
    (["train"], {"ranks": 0}, "-n 0: give the number of ranks, 1 or more"),
    (["train"], {"grace": 0.0}, "--grace 0: give the seconds"),
    (["train"], {"grace": float("nan")}, "--grace nan"),
    (["train"], {"launcher": " "}, "--launcher is empty"),
    (["train"], {"launcher": "'mpiexec"}, "--launcher=\"'mpiexec\": No closing quotation"),
])
def test_bad_input_is_named(command, change, says):
    with pytest.raises(ValueError) as e:
        launch_argv(args(command, **change), {})
    assert says in str(e.value)


def test_a_bad_command_or_launcher_ends_before_anything_starts(cli, tmp_path):
    with pytest.raises(SystemExit) as e:  # the command is parsed as its own first
        cli(["launch", "-n", "2", "--", "trian", "c.toml"])
    assert e.value.code == 2
    rc, _, err = cli(["launch", "--launcher", str(tmp_path / "none"), "--", "status", "RUN"])
    assert rc == 2 and "cannot start the launcher" in err and LAUNCHER_ENV in err
    rc, _, err = cli(["launch", "-n", "2"])
    assert rc == 2 and "give the deepfusion command after --" in err


# A stand-in launcher: it records its session, terminal and every signal that reaches it, says
# "ready", and on a signal writes plenty (into a terminal that may have hung up) and exits 99,
# or (FAKE_MODE=stubborn) goes on until killed.
FAKE = r"""
import os, signal, sys, time
log = open(os.environ["FAKE_LOG"], "a", buffering=1)
try:
    os.close(os.open("/dev/tty", os.O_RDWR)); tty = "tty"
except OSError:
    tty = "no-tty"
log.write(f"start own-session={os.getsid(0) == os.getpid()} {tty}\n")
got = []
def on(sig, frame):
    log.write(f"got {signal.Signals(sig).name}\n"); got.append(sig)
for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, on)
print("ready", flush=True)
while not (got and os.environ.get("FAKE_MODE") != "stubborn"):
    time.sleep(0.05)
for i in range(300):
    print(f"after the stop {i}", flush=True); print(f"and on stderr {i}", file=sys.stderr, flush=True)
sys.exit(99)
"""


def fake_launch(tmp_path, *extra, mode="obey"):
    """argv and env of ``deepfusion launch`` with the stand-in launcher; its log's path."""
    (tmp_path / "fake.py").write_text(FAKE)
    log = tmp_path / "fake.log"
    env = dict(os.environ, PYTHONPATH=ROOT, FAKE_LOG=str(log), FAKE_MODE=mode)
    env.pop("DEEPFUSION_NO_MPI", None)
    launcher = shlex.join([sys.executable, str(tmp_path / "fake.py")])
    argv = [sys.executable, "-m", "deepfusion", "launch", "--launcher", launcher, *extra,
            "--", "status", "RUN"]
    return argv, env, log


def started(argv, env):
    """The launch in the background (SIGHUP as a login shell has it), once its launcher is
    ready."""
    job = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=env, cwd=ROOT, preexec_fn=lambda: signal.signal(HUP, signal.SIG_DFL))
    assert job.stdout.readline().strip() == "ready", job.communicate()[1]
    return job


def test_a_hangup_reaches_the_launcher_as_one_stop_request(tmp_path):
    argv, env, log = fake_launch(tmp_path)
    job = started(argv, env)
    for _ in range(2):  # a closed terminal: the kernel's hang-up and the shell's
        job.send_signal(HUP)
    out, err = job.communicate(timeout=HANG_GUARD)
    assert job.returncode == 99, err
    said = [line for line in err.splitlines() if line.startswith("deepfusion launch:")]
    assert len(said) == 1 and said[0].startswith(
        "deepfusion launch: SIGHUP (the terminal or ssh session closed): SIGUSR1 to python")
    assert "after the stop 299" in out and "and on stderr 299" in err  # all of its output
    assert log.read_text().splitlines() == ["start own-session=True no-tty", "got SIGUSR1"]


def test_a_launcher_that_does_not_stop_gets_term_then_kill(tmp_path):
    argv, env, log = fake_launch(tmp_path, "--grace", "1", mode="stubborn")
    job = started(argv, env)
    job.send_signal(TERM)
    _, err = job.communicate(timeout=HANG_GUARD)
    assert job.returncode == 128 + KILL, err
    said = [line for line in err.splitlines() if line.startswith("deepfusion launch:")]
    assert len(said) == 3, said
    assert "SIGTERM (a request to end): SIGUSR1 to python" in said[0]
    assert "still running 1 s after SIGUSR1: SIGTERM to python" in said[1]
    assert "still running 1 s after SIGTERM: SIGKILL to python" in said[2]
    got = log.read_text().splitlines()[1:]  # a starved host may kill it before it notes one
    assert got == ["got SIGUSR1", "got SIGTERM"][:len(got)], got


def test_a_fault_of_the_launch_itself_stops_the_launcher_with_a_checkpoint(tmp_path, monkeypatch,
                                                                         capfd):
    argv, env, log = fake_launch(tmp_path)
    for k in ("FAKE_LOG", "FAKE_MODE"):
        monkeypatch.setenv(k, env[k])
    real, seen = keeper.pump, []

    def failing(pipes, out, wake, timeout):  # fails once the launcher has said it is ready
        ready = real(pipes, out, wake, timeout)
        seen.append(capfd.readouterr().out)
        if "ready" in "".join(seen):
            raise RuntimeError("a fault of the launch process")
        return ready
    monkeypatch.setattr(keeper, "pump", failing)
    handlers = {sig: signal.getsignal(sig) for sig in keeper.STOPS}
    with pytest.raises(RuntimeError):
        keeper.keep(shlex.split(argv[argv.index("--launcher") + 1]), grace=100)
    assert "stopping python" in capfd.readouterr().err
    until = time.monotonic() + HANG_GUARD
    while "got SIGUSR1" not in log.read_text() and time.monotonic() < until:
        time.sleep(0.1)
    assert log.read_text().splitlines()[1:] == ["got SIGUSR1"]
    assert {sig: signal.getsignal(sig) for sig in keeper.STOPS} == handlers  # ours again


def read_until(fd, token: bytes) -> bytes:
    out, until = b"", time.monotonic() + HANG_GUARD
    while token not in out and time.monotonic() < until:
        if select.select([fd], [], [], 1.0)[0]:
            out += os.read(fd, 4096)
    assert token in out, out[-2000:]
    return out


def in_a_terminal_that_closes(argv, env, ready):
    """Run ``argv`` with a pty as its controlling terminal, close the terminal once ``ready()``
    says so (reading its output meanwhile); the exit code."""
    pid, fd = pty.fork()
    if pid == 0:  # the session leader of the terminal, as a login shell is
        signal.signal(HUP, signal.SIG_DFL)
        os.execvpe(argv[0], argv, env)
    try:
        ready(fd)
    finally:
        os.close(fd)  # the terminal closes: SIGHUP to its session
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_closed_terminal_stops_the_launch_and_it_writes_on_to_nowhere(tmp_path):
    argv, env, log = fake_launch(tmp_path)
    assert in_a_terminal_that_closes(argv, env, lambda fd: read_until(fd, b"ready")) == 99
    assert log.read_text().splitlines() == ["start own-session=True no-tty", "got SIGUSR1"]


# real training under the venv's mpiexec
def launch(args, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    env.pop("DEEPFUSION_NO_MPI", None)
    return [sys.executable, "-m", "deepfusion", "launch", "-n", "2", "--"] + args, env


def checkpoints(run_dir):
    d = os.path.join(run_dir, "checkpoints")
    return sorted(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".h5"))


def resumes(run_dir):
    """--resume continues the stopped run, under deepfusion launch too."""
    done = steps(run_dir)
    argv, env = launch(["train", "--resume", run_dir, "--set", f"train.max_steps={len(done) + 2}"])
    p = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=HANG_GUARD)
    assert p.returncode == 0, p.stderr[-3000:]
    assert steps(run_dir) == list(range(1, len(done) + 3))


@pytest.mark.mpi
@pytest.mark.full
@pytest.mark.parametrize("sig", [HUP, INT], ids=["HUP", "INT"])
def test_a_hangup_or_interrupt_to_the_launch_checkpoints_exits_99_and_resumes(tiny, tmp_path,
                                                                              sig):
    d = str(tmp_path / "run")
    argv, env = launch(["train", tiny, "--set", f"run.dir={d}", "--set", "train.epochs=100000",
                        "--set", "train.checkpoint_every=100000"])
    job = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=env, cwd=ROOT, preexec_fn=lambda: signal.signal(HUP, signal.SIG_DFL))
    try:
        wait_for_steps(d, job, n=1)
        job.send_signal(sig)
        _, err = job.communicate(timeout=HANG_GUARD)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 99, err[-3000:]
    assert f"deepfusion launch: {signal.Signals(sig).name} (" in err
    assert "checkpoint written at step" in err, err[-3000:]
    assert checkpoints(d) and all(seal_status(c) == "sealed" for c in checkpoints(d))
    resumes(d)


@pytest.mark.mpi
@pytest.mark.full
def test_a_closed_terminal_stops_real_training_with_a_checkpoint(tiny, tmp_path):
    d = str(tmp_path / "run")
    argv, env = launch(["train", tiny, "--set", f"run.dir={d}", "--set", "train.epochs=100000",
                        "--set", "train.checkpoint_every=100000"])

    def first_step(fd):
        until = time.monotonic() + HANG_GUARD
        while time.monotonic() < until and not (
                os.path.exists(os.path.join(d, "metrics.jsonl")) and steps(d)):
            if select.select([fd], [], [], 0.2)[0]:
                os.read(fd, 65536)  # the terminal shows it; nobody reads it here
        assert steps(d), "the job did not train"

    assert in_a_terminal_that_closes(argv, env, first_step) == 99
    assert checkpoints(d) and all(seal_status(c) == "sealed" for c in checkpoints(d))
    with open(os.path.join(d, "metrics.jsonl")) as f:
        assert any(json.loads(line).get("kind") == "step" for line in f)
    resumes(d)
