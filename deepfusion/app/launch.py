"""``deepfusion launch``: a deepfusion command on P MPI ranks, started so that a closed
terminal stops it like SIGTERM does (every rank writes a checkpoint and exits 99) instead of
killing every rank without one.

``deepfusion launch -n 2 -- train cfg.toml`` runs ``mpiexec -n 2 PYTHON -m deepfusion train
cfg.toml`` under :func:`deepfusion.engine.run.keeper.keep`: the launcher in a session of its
own, every stop signal (SIGHUP, SIGINT, SIGTERM, SIGUSR1) turned into the SIGUSR1 it passes
on to every rank, SIGTERM and then SIGKILL when it does not end. The launcher is ``--launcher``,
else ``$DEEPFUSION_LAUNCHER`` (a cluster's ``srun --mpi=pmi2`` or ``mpirun``), else the
``mpiexec`` beside this Python (the venv's MPICH), else ``mpiexec`` on PATH. The command after
``--`` is checked with the real parser before anything starts, so a typo costs no launch.
"""
from __future__ import annotations

import argparse
import math
import os
import shlex
import shutil
import sys

from deepfusion.app.policy import ExitCode

LAUNCHER_ENV = "DEEPFUSION_LAUNCHER"
GRACE_S = 120.0
EXAMPLE = "deepfusion launch -n 2 -- train configs/demo.toml"


def register(sub, check=None) -> None:
    """Add ``launch``; ``check(argv)`` parses the command to run (SystemExit on a bad one)."""
    p = sub.add_parser(
        "launch", help="run a deepfusion command on P MPI ranks so that a closed terminal, "
                       "Ctrl-C or SIGTERM stops every rank with a checkpoint (exit 99)",
        description="Run a deepfusion command on P MPI ranks through an MPI launcher kept out "
                    "of the terminal's session: a closed terminal or ssh session (SIGHUP), "
                    "Ctrl-C, SIGTERM or SIGUSR1 stops every rank after its current step with a "
                    "checkpoint (exit 99; --resume continues); a second Ctrl-C or SIGTERM, or "
                    "--grace seconds without an end, ends the ranks without one. Example: "
                    f"{EXAMPLE}")
    p.add_argument("-n", dest="ranks", type=int, metavar="P",
                   help="the number of ranks, passed to the launcher as -n P (leave it out "
                        "where the launcher takes it from the allocation: srun or ibrun in a "
                        "job)")
    p.add_argument("--launcher", metavar="CMD",
                   help=f"the MPI launcher and its options, e.g. 'srun --mpi=pmi2' or 'mpirun "
                        f"--bind-to core' (default: ${LAUNCHER_ENV}, else the mpiexec beside "
                        f"this Python, else mpiexec on PATH)")
    p.add_argument("--grace", type=float, default=GRACE_S, metavar="SECONDS",
                   help=f"seconds the ranks get to write their checkpoint after a stop signal "
                        f"before the launcher gets SIGTERM (the ranks end without one), and "
                        f"as many again before SIGKILL (default {GRACE_S:g})")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="the deepfusion command every rank runs, after --, e.g. -- train "
                        "cfg.toml --set train.max_steps=100")
    p.set_defaults(run=lambda args: run_launch(args, check))


def run_launch(args, check=None) -> int:
    from deepfusion.engine.run.keeper import keep

    try:
        argv = launch_argv(args, os.environ)
    except ValueError as e:
        print(f"deepfusion: error: {e}", file=sys.stderr, flush=True)
        return ExitCode.INPUT
    if check is not None:
        check(command_of(args))  # argparse's own message and exit 2 on a bad command
    try:
        return keep(argv, args.grace)
    except OSError as e:
        print(f"deepfusion: error: cannot start the launcher {shlex.join(argv[:1])}: {e}; give "
              f"the one to use with --launcher CMD or {LAUNCHER_ENV}", file=sys.stderr,
              flush=True)
        return ExitCode.INPUT


def command_of(args) -> list[str]:
    """The deepfusion command after ``--``."""
    return args.command[1:] if args.command[:1] == ["--"] else list(args.command)


def launch_argv(args, env) -> list[str]:
    """The launcher's command line; ValueError naming what is wrong and the fix."""
    command = command_of(args)
    if not command:
        raise ValueError(f"launch: give the deepfusion command after --, e.g. {EXAMPLE}")
    if command[0] == "launch":
        raise ValueError(f"launch: the command after -- is what every rank runs, not another "
                         f"launch: {EXAMPLE}")
    if args.ranks is not None and args.ranks < 1:
        raise ValueError(f"launch: -n {args.ranks}: give the number of ranks, 1 or more")
    if not (args.grace > 0 and math.isfinite(args.grace)):
        raise ValueError(f"launch: --grace {args.grace:g}: give the seconds the ranks get to "
                         f"write their checkpoint, more than 0 (default {GRACE_S:g})")
    launcher = find_launcher(args.launcher, env)
    ranks = ["-n", str(args.ranks)] if args.ranks is not None else []
    return launcher + ranks + [sys.executable, "-m", "deepfusion"] + command


def find_launcher(given: str | None, env) -> list[str]:
    """The launcher command: ``given``, else ``$DEEPFUSION_LAUNCHER``, else the mpiexec beside
    this Python, else mpiexec on PATH; ValueError when there is none."""
    text, source = (given, "--launcher") if given is not None else (env.get(LAUNCHER_ENV),
                                                                     LAUNCHER_ENV)
    if text is not None:
        try:
            words = shlex.split(text)
        except ValueError as e:
            raise ValueError(f"launch: {source}={text!r}: {e}") from None
        if not words:
            raise ValueError(f"launch: {source} is empty: give the launcher, e.g. mpiexec or "
                             f"'srun --mpi=pmi2'")
        return words
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = beside if os.access(beside, os.X_OK) else shutil.which("mpiexec")
    if found is None:
        raise ValueError(f"launch: no mpiexec beside {sys.executable} or on PATH: give the "
                         f"launcher with --launcher CMD or {LAUNCHER_ENV} (e.g. 'srun "
                         f"--mpi=pmi2', 'mpirun')")
    return [found]
