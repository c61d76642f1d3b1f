"""Keep an MPI launcher where a closed terminal cannot kill it, and turn every stop signal into
the one request the launcher passes on to every rank.

A closed terminal or ssh session sends SIGHUP to the processes of its session. MPICH's
``mpiexec`` (hydra) dies of it and its proxies SIGKILL the ranks (:mod:`.hangup`); ``srun``
answers SIGHUP and SIGTERM by SIGKILLing its tasks, and answers a single SIGINT with a status
line only; Open MPI's ``mpirun`` follows SIGTERM or SIGINT with SIGKILL a few seconds later.
Each of them passes SIGUSR1 on to every rank unchanged, and every rank of ``deepfusion train``
takes SIGUSR1 as a stop request (a checkpoint after the current step, exit 99).

:func:`keep` starts the launcher in a session of its own (no controlling terminal, so no
hang-up reaches it; stdin from /dev/null), copies its output to ours (to nowhere once ours
fails: a terminal that hung up answers EIO, and the launcher must never be the one to hit
that), and answers the stop signals this process hears as :class:`Ladder` says:

* the first SIGHUP, SIGINT, SIGTERM or SIGUSR1: SIGUSR1 to the launcher;
* its copies (within ``DUP_S`` seconds: a hang-up arrives from the kernel and from the shell),
  and any later SIGHUP or SIGUSR1: nothing more;
* a later SIGINT or SIGTERM (Ctrl-C twice), or ``grace`` seconds with the launcher still
  running: SIGTERM to the launcher, which each rank's watchdog takes as a second signal (the
  rank ends at once, without a checkpoint, its Python stack printed); the next: SIGKILL to the
  launcher (hydra's proxies and srun's shepherd then end the ranks).

A SIGHUP ignored at start stays ignored (``nohup deepfusion launch ...`` asked to outlive the
terminal, not to stop when it closes), as :mod:`.stop` does for a rank.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from dataclasses import dataclass

from deepfusion.engine.run.watchdog import DUP_S  # copies of one request, for the ranks too

STOPS = (signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
LEVELS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGKILL)  # what the launcher gets, in turn
POLL_S = 1.0  # how often the launcher's exit is checked when nothing arrives
CAUSES = {signal.SIGHUP: "the terminal or ssh session closed", signal.SIGINT: "Ctrl-C",
          signal.SIGTERM: "a request to end", signal.SIGUSR1: "a stop request"}


@dataclass(frozen=True)
class Step:
    """A signal for the launcher and the line that says why (``{who}``: the launcher)."""

    send: int
    why: str


class Ladder:
    """What the launcher gets, from the stop signals heard and the time: feed it signals, ask
    it what is due; pure, so the rules are tested on made-up times."""

    def __init__(self, grace: float):
        self.grace = grace
        self.level = -1          # index into LEVELS of the last signal sent; -1: none yet
        self.since = 0.0         # monotonic time of that signal

    def heard(self, sig: int, now: float) -> Step | None:
        name = signal.Signals(sig).name
        if self.level < 0:
            return self._up(now, f"{name} ({CAUSES[sig]}): SIGUSR1 to {{who}}: every rank "
                                 f"stops after its current step with a checkpoint and exits 99; "
                                 f"--resume RUN_DIR continues the run")
        if sig in (signal.SIGHUP, signal.SIGUSR1) or now - self.since <= DUP_S:
            return None
        return self._up(now, f"another {name}: " + self._harder())

    def due(self, now: float) -> Step | None:
        if 0 <= self.level < len(LEVELS) - 1 and now >= self.since + self.grace:
            before = signal.Signals(LEVELS[self.level]).name
            return self._up(now, f"{{who}} still running {self.grace:g} s after {before}: "
                                 + self._harder())
        return None

    def wait_s(self, now: float) -> float:
        if 0 <= self.level < len(LEVELS) - 1:
            return max(0.0, min(POLL_S, self.since + self.grace - now))
        return POLL_S

    def _harder(self) -> str:
        if self.level == 0:
            return ("SIGTERM to {who}: every rank still running ends now, without a "
                    "checkpoint (one stuck in native code prints its Python stack)")
        if self.level == 1:
            return "SIGKILL to {who}: its ranks end with it"
        return ""

    def _up(self, now: float, why: str) -> Step | None:
        if self.level >= len(LEVELS) - 1:
            return None
        self.level, self.since = self.level + 1, now
        return Step(LEVELS[self.level], why)


class Output:
    """Our stdout and stderr as the launcher's output reaches them: a write that fails (a
    terminal that hung up: EIO; a reader that left: EPIPE) turns that stream off for good,
    and the launcher's output goes on being read, so it never blocks on a full pipe."""

    def __init__(self):
        self.off: set[int] = set()

    def write(self, fd: int, data: bytes) -> None:
        while data and fd not in self.off:
            try:
                data = data[os.write(fd, data):]
            except InterruptedError:
                continue
            except OSError:
                self.off.add(fd)

    def say(self, line: str) -> None:
        self.write(2, f"deepfusion launch: {line}\n".encode())


def keep(argv: list[str], grace: float, out: Output | None = None) -> int:
    """Run the launcher command ``argv`` as the module says; its exit code (128 + N when a
    signal N ended it). OSError when it cannot be started."""
    out = out or Output()
    ladder, wake_r, kept = Ladder(grace), *listen()
    try:
        heard = drain(wake_r)
        if heard:  # stopped before anything started: start nothing
            out.say(f"{signal.Signals(heard[0]).name} before the launcher started: not started")
            return 128 + heard[0]
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        try:
            code = watch(proc, ladder, wake_r, out)
        except BaseException:  # a fault of ours must not leave the job running unwatched
            if proc.poll() is None:
                out.say(f"stopping {os.path.basename(argv[0])} (PID {proc.pid}) with a "
                        f"checkpoint (SIGUSR1): this process failed")
                signal_quietly(proc.pid, signal.SIGUSR1)
            raise
        return code if code >= 0 else 128 - code
    finally:
        restore(kept, wake_r)


def watch(proc, ladder: Ladder, wake_r: int, out: Output) -> int:
    """Relay ``proc``'s output and answer the stop signals until it ends; its return code."""
    who = f"{os.path.basename(proc.args[0])} (PID {proc.pid})"
    pipes = {proc.stdout: 1, proc.stderr: 2}
    while True:
        ready = pump(pipes, out, wake_r, ladder.wait_s(time.monotonic()))
        now = time.monotonic()
        heard = drain(wake_r) if wake_r in ready else []
        for step in [ladder.heard(s, now) for s in heard] + [ladder.due(now)]:
            if step is not None and proc.poll() is None:
                out.say(step.why.format(who=who))
                signal_quietly(proc.pid, step.send)
        if proc.poll() is not None and not (pipes and ready):
            break  # ended, and its output with it (or nothing more came: a process it
            # started holds a pipe)
    return proc.wait()


def listen():
    """Catch the stop signals from now on, their numbers written to a pipe (its read end, and
    what to restore). A SIGHUP ignored at start stays ignored."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    os.set_blocking(r, False)
    kept = {s: signal.getsignal(s) for s in STOPS}
    for sig in STOPS:
        if not (sig == signal.SIGHUP and kept[sig] == signal.SIG_IGN):
            signal.signal(sig, lambda *_: None)  # the number reaches the pipe from C
    kept["wakeup"] = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    kept["w"] = w
    return r, kept


def restore(kept: dict, r: int) -> None:
    signal.set_wakeup_fd(kept.pop("wakeup"))
    for fd in (r, kept.pop("w")):
        os.close(fd)
    for sig, handler in kept.items():
        signal.signal(sig, handler)


def drain(r: int) -> list[int]:
    """The stop signals heard since the last call, in order."""
    got = b""
    while True:
        try:
            chunk = os.read(r, 512)
        except BlockingIOError:
            break
        if not chunk:
            break
        got += chunk
    return [b for b in got if b in STOPS]


def pump(pipes: dict, out: Output, wake: int, timeout: float) -> list:
    """Copy what the launcher writes within ``timeout`` seconds (``pipes``: its pipe -> our
    fd; a pipe at its end is closed and dropped); what was ready (pipes, ``wake``)."""
    ready, _, _ = select.select(list(pipes) + [wake], [], [], timeout)
    for pipe in ready:
        if pipe in pipes:
            data = os.read(pipe.fileno(), 65536)
            if data:
                out.write(pipes[pipe], data)
            else:
                pipe.close()
                del pipes[pipe]
    return ready


def signal_quietly(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # it ended meanwhile: nothing left to signal
        pass
