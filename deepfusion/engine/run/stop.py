"""Stop requests: SIGTERM and SIGUSR1 (Slurm's time-limit warning, ``--signal=B:USR1@N``),
SIGINT (Ctrl-C at the terminal, which ``mpiexec`` forwards to every rank) and SIGHUP (the
terminal or ssh session closed; left ignored under ``nohup``; MPICH's ``mpiexec`` dies of it
instead of forwarding it: :mod:`.hangup`), and the watchdog that ends a rank Python cannot stop.

The first signal only records the request; the trainer puts it in the next step's fused
allreduce, so every rank stops after the same step, writes a checkpoint and exits 99. The
handler is installed when the train command starts, before MPI and torch are loaded, so a signal
that arrives during start-up (a short time limit, a job cancelled while it loads) is kept for
the first step instead of killing the rank with the default action.

A rank stuck in native code never reaches that step, so each rank also has a watchdog process
(:mod:`.watchdog`) that hears every signal through the wakeup pipe, even while the rank's
Python is stuck: a second SIGTERM, SIGINT or SIGHUP (more than a few seconds after the first),
or ``DEEPFUSION_STOP_DEADLINE`` seconds (default 60; 0: never) after the first of them, ends the
rank with its Python stack printed. It also bounds the wait at start-up (``MPI_Init`` and the
first exchange) for peers that never come (:func:`starting`, ``DEEPFUSION_START_TIMEOUT``,
default 300 s; 0: never).
"""
from __future__ import annotations

import errno
import faulthandler
import os
import signal
import subprocess
import sys
from contextlib import contextmanager

from deepfusion.engine.run import watchdog

# all of them stop the run with a checkpoint: losing the steps since the last one to a Ctrl-C
# or a dropped ssh session would cost as much as a time limit
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
DEADLINE_ENV, DEADLINE_S = "DEEPFUSION_STOP_DEADLINE", 60.0
START_ENV, START_S = "DEEPFUSION_START_TIMEOUT", 300.0
_requested = False
_watch: dict = {}  # this process's watchdog: pid (of this process), proc, fd (write end)


def _handler(signum, frame):
    global _requested
    _requested = True
    if signum == signal.SIGHUP:
        quiet_dead_terminal()


def quiet_dead_terminal() -> None:
    """Point stdout and stderr at /dev/null where they are a terminal that hung up (a write
    there fails with EIO), so the stop's checkpoint, message and exit 99 do not fail on output
    nobody can read any more. A live terminal, a file or a pipe is left as it is."""
    for fd in (1, 2):
        try:
            os.write(fd, b"")
        except OSError as e:
            if e.errno == errno.EIO:
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, fd)
                os.close(null)


def seconds(var: str, default: float) -> float:
    """A duration in seconds from the environment (0 or more; 0 means never)."""
    text = os.environ.get(var, "").strip()
    try:
        value = float(text) if text else default
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{var}={text!r}: give a number of seconds (0 turns it off)")
    return value


def watch() -> None:
    """Start this process's watchdog (once; call before MPI_Init). ValueError on a malformed
    DEEPFUSION_STOP_DEADLINE or DEEPFUSION_START_TIMEOUT."""
    deadline, start = seconds(DEADLINE_ENV, DEADLINE_S), seconds(START_ENV, START_S)
    if _watch.get("pid") == os.getpid() and _watch["proc"].poll() is None:
        return
    r, w = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", watchdog.__file__, str(os.getpid()), str(r),
             str(deadline), str(start)], pass_fds=(r,), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL)
    except OSError as e:  # no process to spare: stop signals still work as requests
        os.close(w)
        print(f"deepfusion: warning: no stop watchdog ({e}): a rank stuck in native code "
              f"ignores SIGTERM", file=sys.stderr, flush=True)
        return
    finally:
        os.close(r)
    os.set_blocking(w, False)  # the C-level signal handler must never block on it
    _watch.update(pid=os.getpid(), proc=proc, fd=w)
    faulthandler.register(signal.SIGUSR2, file=sys.__stderr__, all_threads=True)


def install() -> None:
    """Catch the stop signals from now on, and let the watchdog hear them (idempotent). A
    SIGHUP ignored at start stays ignored: ``nohup deepfusion train ...`` asked to outlive the
    terminal, not to stop when it closes."""
    for sig in SIGNALS:
        if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
            continue
        signal.signal(sig, _handler)
    watch()
    if _watch.get("pid") == os.getpid():
        signal.set_wakeup_fd(_watch["fd"], warn_on_full_buffer=False)


def _tell(byte: int) -> None:
    if _watch.get("pid") == os.getpid():
        try:
            os.write(_watch["fd"], bytes([byte]))
        except OSError:  # the watchdog is gone: nothing to tell
            pass


@contextmanager
def starting():
    """The block waits for every process of the launch (MPI_Init, the first exchange): the
    watchdog (started here if it is not yet) ends this one if the others do not come within
    DEEPFUSION_START_TIMEOUT seconds. ValueError as :func:`watch`."""
    watch()
    _tell(watchdog.START)
    try:
        yield
    finally:
        _tell(watchdog.STARTED)


def requested() -> bool:
    return _requested


def reason(flags: dict, time_limit_minutes: float) -> str:
    """Why every rank stops after a step whose agreed ``flags`` (a stop signal, the time
    limit ``train.time_limit_minutes``) say so, or ""."""
    if flags["stop"] > 0:
        return "stop signal received"
    if flags["time_limit"] > 0:
        return f"train.time_limit_minutes = {time_limit_minutes:g} reached"
    return ""
