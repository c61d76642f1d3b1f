"""The stop watchdog: a small process beside each rank that ends it when Python cannot.

A rank stuck in native code (a C call that does not return: ``MPI_Init`` waiting for peers that
never come, a parser looping on a damaged file) never runs its Python signal handlers, and no
Python thread runs either while that code holds the GIL (``MPI_Init`` does). The kernel still
runs Python's C-level handler, which writes the signal's number to the wakeup pipe
(``signal.set_wakeup_fd``); this process reads that pipe and keeps the clock. The rank writes
two control bytes of its own: START before ``MPI_Init`` (and before the first exchange of the
ranks) and STARTED after it.

The rules (:class:`Watch`): the first stop signal only asks for a checkpoint (the rank's
Python handler does that); SIGINT (Ctrl-C) and SIGHUP (a closed terminal) count as SIGTERM. A
SIGTERM that comes more than ``DUP_S`` seconds after the first
stop signal, or ``deadline`` seconds after the first SIGTERM with the rank still running, or
``start`` seconds at start-up (``MPI_Init`` and the first exchange), ends the rank: a message,
its Python stack (SIGUSR2, which the rank's faulthandler answers from C), then SIGKILL.
Signals within ``DUP_S`` of the first are copies of one request (Slurm signals every process of
a job, and the job script and the launcher forward the same signal again). SIGUSR1 (Slurm's warning before the time limit) starts
no deadline: the limit's own SIGTERM follows.

Run as ``python -I -S watchdog.py PID FD DEADLINE START`` (standard library only); it ends when
its rank does (end of file on the pipe, or a new parent) and ignores the stop signals itself.
"""
from __future__ import annotations

import os
import select
import signal
import sys
import time

START, STARTED = 0xF0, 0xF1  # control bytes; signal numbers are below 65
DUP_S = 5.0
POLL_S = 1.0  # how often the rank's existence is checked when nothing arrives
ENDING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)   # each asks the rank to end


class Watch:
    """The clock of one rank: feed it bytes, ask it what is due; a reason to end the rank,
    else ""."""

    def __init__(self, deadline: float, start: float):
        self.deadline, self.start = deadline, start
        self.first: float | None = None  # monotonic time of the first stop signal
        self.end_at: tuple[float, str] | None = None
        self.start_by: float | None = None

    def feed(self, byte: int, now: float) -> str:
        if byte == START and self.start > 0:
            self.start_by = now + self.start
        elif byte == STARTED:
            self.start_by = None
        elif byte in ENDING or byte == signal.SIGUSR1:
            term = byte in ENDING
            if self.first is not None and term and now - self.first > DUP_S:
                return (f"a second SIGTERM, {now - self.first:.0f} s after the first stop "
                        f"signal: ending it now, without a checkpoint")
            self.first = now if self.first is None else self.first
            if term and self.end_at is None and self.deadline > 0:
                self.end_at = (now + self.deadline, (
                    f"still running {self.deadline:g} s after SIGTERM "
                    f"(DEEPFUSION_STOP_DEADLINE): stuck in native code, or a checkpoint not "
                    f"written in time; ending it now"))
        return ""

    def due(self, now: float) -> str:
        if self.end_at is not None and now >= self.end_at[0]:
            return self.end_at[1]
        if self.start_by is not None and now >= self.start_by:
            return (f"waited {self.start:g} s at start-up (MPI_Init, the first exchange) for "
                    f"the other processes of the launch (DEEPFUSION_START_TIMEOUT), which never "
                    f"joined: one of them exited or runs something else (an MPMD launch with "
                    f"another program on some ranks, DEEPFUSION_NO_MPI=1 on some ranks). Ending "
                    f"it: launch every rank with the same deepfusion command")
        return ""

    def wait_s(self, now: float) -> float:
        times = [t for t in (self.end_at and self.end_at[0], self.start_by) if t is not None]
        return max(0.0, min([now + POLL_S] + times) - now)


def who(pid: int) -> str:
    rank = next((os.environ[v] for v in ("PMI_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")
                 if v in os.environ), None)
    where = f"PID {pid} on {os.uname().nodename}"
    return f"rank {rank} ({where})" if rank is not None else where


def end(pid: int, why: str) -> None:
    """Say why, have the rank print its Python stack, and kill it."""
    os.write(2, f"deepfusion: {who(pid)}: {why}. Its Python stack:\n".encode())
    try:
        os.kill(pid, signal.SIGUSR2)
        time.sleep(1.0)  # faulthandler writes from the rank's C handler: no GIL needed
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv: list[str]) -> int:
    pid, fd, deadline, start = int(argv[1]), int(argv[2]), float(argv[3]), float(argv[4])
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    watch = Watch(deadline, start)
    while True:
        ready, _, _ = select.select([fd], [], [], watch.wait_s(time.monotonic()))
        if os.getppid() != pid:
            return 0
        now = time.monotonic()
        data = os.read(fd, 512) if ready else b""
        if ready and not data:
            return 0  # every writer closed the pipe: the rank has ended
        for why in [watch.feed(b, now) for b in data] + [watch.due(now)]:
            if why:
                end(pid, why)
                return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
