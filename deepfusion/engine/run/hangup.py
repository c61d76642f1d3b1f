"""Whether a closed terminal would end this job without a checkpoint, and the line that says so.

A closed terminal or ssh session sends SIGHUP to the processes of the terminal's session: the
shell and its jobs, so the launcher (``mpiexec``), never the ranks. MPICH's ``mpiexec`` (hydra)
does not catch SIGHUP: it dies of it, and its proxies then SIGKILL the ranks, which run in
sessions of their own. No rank hears a catchable signal, so none can write a checkpoint; what
saves the run is to start the launcher where no hang-up reaches it: ``deepfusion launch`` (the
launcher in a session of its own, the hang-up turned into a stop with a checkpoint:
:mod:`.keeper`), ``nohup`` (SIGHUP ignored, which the launcher keeps), ``setsid`` (no
terminal), ``tmux``/``screen`` (a terminal that outlives the session) or a batch job.

:func:`at_risk` decides from the environment and the chain of processes from this one up
(:func:`process_chain`, read from ``/proc``): the launcher above this process is at risk when
it has a controlling terminal and does not ignore SIGHUP. Without a launcher (``deepfusion
train`` alone) this process hears the hang-up itself and stops with a checkpoint
(:mod:`.stop`). Linux only: without ``/proc`` the chain is empty and nothing is said.
"""
from __future__ import annotations

import os
import shlex
import signal
from dataclasses import dataclass

# a job of a batch system: its launcher has no terminal to lose (an interactive allocation
# ends with its terminal whatever the launcher does)
BATCH_ENV = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "COBALT_JOBID", "FLUX_JOB_ID", "JOB_ID")
# a terminal multiplexer's terminal stays open when the ssh session closes
MULTIPLEXER_ENV = ("TMUX", "STY")
LAUNCHERS = ("mpiexec", "mpirun", "mpiexec.hydra", "mpiexec.mpich", "mpirun.mpich",
             "mpiexec.openmpi", "mpirun.openmpi", "orterun", "prterun")
DEPTH = 6  # ancestors looked at: rank, proxy, mpiexec, a shell or two


@dataclass(frozen=True)
class Proc:
    """One process of the chain: its pid, whether it has a controlling terminal, whether it
    ignores SIGHUP, and its command line (for the advice)."""

    pid: int
    terminal: bool
    ignores_hup: bool
    argv: tuple = ()

    def launches(self) -> bool:
        """Whether this is an MPI launcher (by its program's name)."""
        return bool(self.argv) and os.path.basename(self.argv[0]) in LAUNCHERS


def at_risk(env, chain: list[Proc]) -> Proc | None:
    """The launcher a closed terminal would kill, taking this job down without a checkpoint
    (``chain``: this process first, then its ancestors); None when a hang-up cannot end it so:
    a batch job, a terminal multiplexer, no launcher above this process (it catches SIGHUP
    itself and checkpoints), a launcher without a terminal (``setsid``) or one that ignores
    SIGHUP (``nohup``)."""
    if any(env.get(k) for k in BATCH_ENV + MULTIPLEXER_ENV):
        return None
    launcher = next((p for p in chain[1:] if p.launches()), None)
    if launcher is None or not launcher.terminal or launcher.ignores_hup:
        return None
    return launcher


def warning(launcher: Proc, argv: list[str], ranks: int | None = None) -> str:
    """The line rank 0 prints at start when ``launcher`` is at risk; ``argv``: this command's
    (``sys.argv``) and ``ranks`` its number of ranks, for the exact commands that survive the
    terminal."""
    run = launcher.argv or ("mpiexec", "...", "deepfusion", *argv[1:])
    cmd = shlex.join(run)
    return (f"started from a terminal: if it closes (a dropped ssh session), its hang-up kills "
            f"the launcher (PID {launcher.pid}) and every rank at once, without a checkpoint, "
            f"losing the steps since the last one. Start it as "
            f"{launch_command(launcher.argv, argv, ranks)} and a closed terminal stops every "
            f"rank with a checkpoint (exit 99); or outlive the terminal: nohup {cmd} "
            f"> train.log 2>&1 & (or setsid, tmux or screen, or a batch job: deepfusion jobs "
            f"render); --resume continues from the newest checkpoint either way")


def launch_command(launcher_argv, argv: list[str], ranks: int | None = None) -> str:
    """``deepfusion launch`` for the same job: the launcher's -n (or ``ranks``), and its name
    and other options as ``--launcher`` unless it is a plain ``mpiexec``."""
    words, args = list(launcher_argv), list(argv[1:])
    if args and words[-len(args):] == args:
        words = words[:-len(args)]
    if words[-2:] == ["-m", "deepfusion"]:
        words = words[:-2]
        while words and not os.path.basename(words[-1]).startswith("python"):
            words.pop()  # the interpreter's own options
        words = words[:-1]
    elif words and os.path.basename(words[-1]) == "deepfusion":
        words = words[:-1]
    else:
        words = []  # a program of its own between launcher and deepfusion: launcher unknown
    head, opts, n = words[:1], [], str(ranks) if ranks else "P"
    it = iter(words[1:])
    for w in it:
        if w in ("-n", "-np"):
            n = next(it, n)
        else:
            opts.append(w)
    plain = head and os.path.basename(head[0]) == "mpiexec" and not opts
    given = "" if plain or not head else f"--launcher {shlex.quote(shlex.join(head + opts))} "
    return f"deepfusion launch {given}-n {n} -- {shlex.join(args)}"


def process_chain(pid: int | None = None, depth: int = DEPTH) -> list[Proc]:
    """``pid`` (this process by default) and its ancestors, nearest first, as far as ``/proc``
    tells; [] where it cannot be read."""
    chain, pid = [], os.getpid() if pid is None else pid
    while pid > 1 and len(chain) < depth:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/status") as f:
                ignored = next(line.split()[1] for line in f if line.startswith("SigIgn:"))
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = tuple(a.decode(errors="replace") for a in f.read().split(b"\0") if a)
        except (OSError, StopIteration, IndexError):
            break
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid ...
        hup = 1 << (signal.SIGHUP - 1)
        chain.append(Proc(pid, terminal=int(fields[4]) != 0,
                          ignores_hup=bool(int(ignored, 16) & hup), argv=argv))
        pid = int(fields[1])
    return chain


def note(argv: list[str], ranks: int | None = None) -> str:
    """The warning for this process of ``ranks``, or "" (nothing at risk, or nothing to
    read)."""
    launcher = at_risk(os.environ, process_chain())
    return warning(launcher, argv, ranks) if launcher is not None else ""
