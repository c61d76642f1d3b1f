"""A closed terminal kills MPICH's mpiexec and its ranks without a checkpoint (hydra SIGKILLs the
ranks, which hear no signal): `deepfusion train` says so at start when it is at risk, with the
command that avoids it, and says nothing in a batch job, under tmux/screen, under nohup or
setsid. The rule is unit-tested on made-up process chains; the chain itself is read from real
launches in a real terminal (a pty), under the venv's mpiexec."""
from __future__ import annotations

import os
import pty
import shlex
import signal
import subprocess
import sys
import time

import pytest

from deepfusion.engine.run import hangup
from deepfusion.engine.run.hangup import Proc, at_risk, process_chain, warning
from tests.mpi_util import HANG_GUARD

RANK = Proc(30, terminal=False, ignores_hup=False)          # hydra runs each rank in a session
PROXY = Proc(20, terminal=False, ignores_hup=False)
MPIEXEC = Proc(10, terminal=True, ignores_hup=False, argv=("mpiexec", "-n", "2", "deepfusion",
                                                            "train", "c.toml"))
SHELL = Proc(5, terminal=True, ignores_hup=False)


def test_a_launcher_on_a_terminal_is_at_risk():
    assert at_risk({}, [RANK, PROXY, MPIEXEC, SHELL]) is MPIEXEC


@pytest.mark.parametrize("var", hangup.BATCH_ENV + hangup.MULTIPLEXER_ENV)
def test_a_batch_job_or_a_multiplexer_is_not(var):
    assert at_risk({var: "123"}, [RANK, PROXY, MPIEXEC, SHELL]) is None


def test_nohup_setsid_or_no_launcher_is_not():
    nohup = Proc(10, terminal=True, ignores_hup=True, argv=MPIEXEC.argv)
    assert at_risk({}, [RANK, PROXY, nohup, SHELL]) is None          # nohup mpiexec ...
    setsid = Proc(10, terminal=False, ignores_hup=False, argv=MPIEXEC.argv)
    assert at_risk({}, [RANK, PROXY, setsid, SHELL]) is None         # setsid mpiexec ...
    alone = Proc(30, terminal=True, ignores_hup=False, argv=("deepfusion", "train"))
    assert at_risk({}, [alone, SHELL]) is None     # no mpiexec: it hears SIGHUP, checkpoints
    assert at_risk({}, []) is None                                    # no /proc


def test_a_launcher_is_known_by_its_program_name():
    hydra = Proc(10, True, False, argv=("/opt/mpich/bin/mpiexec.hydra", "-n", "4", "x"))
    assert hydra.launches() and not SHELL.launches() and not RANK.launches()
    assert at_risk({}, [RANK, PROXY, hydra, SHELL]) is hydra


def test_the_warning_gives_the_exact_command_that_outlives_the_terminal():
    text = warning(MPIEXEC, ["deepfusion", "train", "c.toml"], ranks=2)
    assert "without a checkpoint" in text and "PID 10" in text
    assert ("Start it as deepfusion launch -n 2 -- train c.toml and a closed terminal stops "
            "every rank with a checkpoint (exit 99)") in text
    assert "nohup mpiexec -n 2 deepfusion train c.toml > train.log 2>&1 &" in text
    assert "setsid" in text and "tmux" in text and "batch job" in text


@pytest.mark.parametrize("launcher,argv,ranks,launch", [
    (("mpiexec", "-n", "2", "deepfusion", "train", "c.toml"), ["/v/bin/deepfusion", "train",
     "c.toml"], 2, "deepfusion launch -n 2 -- train c.toml"),
    (("/v/bin/mpiexec", "-np", "4", "-bind-to", "core", "/v/bin/python3", "-u", "-m",
      "deepfusion", "train", "a b.toml"), ["/x/__main__.py", "train", "a b.toml"], 4,
     "deepfusion launch --launcher '/v/bin/mpiexec -bind-to core' -n 4 -- train 'a b.toml'"),
    (("srun", "--mpi=pmi2", "deepfusion", "train", "c.toml"), ["deepfusion", "train", "c.toml"],
     8, "deepfusion launch --launcher 'srun --mpi=pmi2' -n 8 -- train c.toml"),
    ((), ["deepfusion", "train", "c.toml"], None, "deepfusion launch -n P -- train c.toml"),
])
def test_the_launch_command_keeps_the_launcher_and_its_options(launcher, argv, ranks, launch):
    assert hangup.launch_command(launcher, argv, ranks) == launch


def test_the_chain_of_this_process_is_read_from_proc():
    if not os.path.exists("/proc/self/stat"):
        pytest.skip("no /proc")
    chain = process_chain()
    assert chain[0].pid == os.getpid() and chain[1].pid == os.getppid()
    assert chain[0].argv and chain[0].ignores_hup == (
        signal.getsignal(signal.SIGHUP) == signal.SIG_IGN)


PROBE = ("import os; from deepfusion.engine.run.hangup import at_risk, process_chain; "
         "p = at_risk(os.environ, process_chain()); print('AT-RISK', p and p.argv[0])")


def in_terminal(shell_cmd: str) -> str:
    """Run ``shell_cmd`` with a pty as its controlling terminal; its output."""
    env = {k: v for k, v in os.environ.items()
           if k not in hangup.BATCH_ENV + hangup.MULTIPLEXER_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [os.getcwd(), env.get("PYTHONPATH")] if p)
    pid, fd = pty.fork()
    if pid == 0:  # the child: a session leader with the pty as its terminal
        signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as a login shell has it, whatever ours
        os.execvpe("sh", ["sh", "-c", shell_cmd], env)
    out, until = b"", time.monotonic() + HANG_GUARD
    try:
        while time.monotonic() < until:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # EIO: the terminal's last writer has gone
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(fd)
        os.waitpid(pid, 0)
    return out.decode(errors="replace")


MPIEXEC_BIN = os.path.join(os.path.dirname(sys.executable), "mpiexec")


@pytest.mark.mpi
@pytest.mark.skipif(not os.path.exists(MPIEXEC_BIN), reason="no mpiexec beside the python")
@pytest.mark.parametrize("prefix,risk", [("", True), ("nohup ", False), ("setsid -w ", False)])
def test_real_launches_in_a_terminal(prefix, risk):
    out = in_terminal(f"{prefix}{MPIEXEC_BIN} -n 1 {sys.executable} -c \"{PROBE}\" 2>&1 | cat")  # (a pipe: nohup keeps stdout)
    line = next(x for x in out.splitlines() if "AT-RISK" in x)
    assert line.strip() == (f"AT-RISK {MPIEXEC_BIN}" if risk else "AT-RISK None"), out


@pytest.mark.mpi
@pytest.mark.skipif(not os.path.exists(MPIEXEC_BIN), reason="no mpiexec beside the python")
def test_a_launch_under_deepfusion_launch_is_not_at_risk():
    """deepfusion launch keeps the launcher out of the terminal's session: nothing to warn of
    (the probe stands where the ranks' program is; it ignores the command after it)."""
    probe = shlex.join([MPIEXEC_BIN, "-n", "1", sys.executable, "-c", PROBE])
    out = in_terminal(shlex.join([sys.executable, "-m", "deepfusion", "launch", "--launcher",
                                  probe, "--", "status", "RUN"]))
    line = next(x for x in out.splitlines() if "AT-RISK" in x)
    assert line.strip() == "AT-RISK None", out


def test_a_hangup_ignored_at_start_stays_ignored():
    """nohup deepfusion train: the stop handler leaves an ignored SIGHUP ignored."""
    code = ("import signal; signal.signal(signal.SIGHUP, signal.SIG_IGN); "
            "from deepfusion.engine.run import stop; stop.install(); "
            "print(signal.getsignal(signal.SIGHUP) == signal.SIG_IGN, "
            "callable(signal.getsignal(signal.SIGTERM)))")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=HANG_GUARD)
    assert out.stdout.split() == ["True", "True"], out.stderr


STOPS = ("import os, sys, time; from deepfusion.engine.run import stop; stop.install(); "
         "print('ready', flush=True)\n"
         "while not stop.requested(): time.sleep(0.05)\n"
         "print('checkpoint written: after the terminal is gone', flush=True)\n"
         "sys.stderr.write('and on stderr\\n'); open(sys.argv[1], 'w').write('stopped')")


def test_a_run_on_a_terminal_that_closes_stops_cleanly(tmp_path):
    """deepfusion train without mpiexec hears the hang-up itself: its messages after it go
    nowhere instead of failing on the dead terminal (EIO), so it stops as on SIGTERM."""
    marker = str(tmp_path / "stopped")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    pid, fd = pty.fork()
    if pid == 0:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        os.execvpe(sys.executable, [sys.executable, "-c", STOPS, marker], env)
    out, until = b"", time.monotonic() + HANG_GUARD
    while b"ready" not in out and time.monotonic() < until:
        out += os.read(fd, 1024)
    os.close(fd)                                     # the terminal closes: SIGHUP
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out
    assert open(marker).read() == "stopped"
