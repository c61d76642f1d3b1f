"""The error policy and the exit codes: every rank, never a hang.

* input errors (config, CLI, files, a checkpoint that cannot be read) are found before the
  first training collective; ranks exchange their status (:func:`collective_check`) and all
  exit with :data:`ExitCode.INPUT` and one message;
* decisions taken on all-reduced values (non-finite loss, diverged parameters, stop signal)
  end all ranks together with their own exit code;
* anything else raised on one rank prints that rank's message and calls MPI Abort, which ends
  every rank of the job promptly: no rank returns while others may wait in a collective.
"""
from __future__ import annotations

import sys
import traceback
import warnings
from enum import IntEnum

from deepfusion.engine.errors import InputError, NonFiniteLoss, ParametersDiverged, Preempted


class ExitCode(IntEnum):
    """The one definition of every exit code of ``deepfusion``."""

    OK = 0
    ABORT = 1        # an exception on some rank (MPI_Abort)
    INPUT = 2        # bad input: config, CLI, files
    NONFINITE = 3    # non-finite loss/gradient, or ranks' parameters diverged
    PREEMPTED = 99   # stopped (SIGTERM/SIGUSR1, train.time_limit_minutes) after a checkpoint:
                     # requeue with --resume


# InputError too: a check that raises it on one rank must not leave the others in the exchange
INPUT_ERRORS = (ValueError, KeyError, TypeError, OSError, InputError)


def collective_check(comm, fn, *args):
    """Run ``fn`` on every rank; if any rank fails with an input error, every rank raises
    InputError with the first failing rank's message. Every rank reaches the exchange, so nobody
    waits forever."""
    try:
        out, err = fn(*args), None
    except INPUT_ERRORS as e:
        out, err = None, f"{e}"
    raise_first(comm.allgather_obj(err))
    return out


def raise_first(errors: list) -> None:
    """InputError with the first rank's message of ``errors`` (one entry per rank, None where
    that rank passed), named by its rank when there are several; nothing if all passed. The
    one wording of a refused start-up, for a real launch and for ``deepfusion check``."""
    bad = [(r, m) for r, m in enumerate(errors) if m is not None]
    if bad:
        r, msg = bad[0]
        raise InputError(msg if len(errors) == 1 else f"(rank {r}) {msg}")


def say_once(comm, msg: str, *, err: bool = True) -> None:
    """A message all ranks agree on, printed by rank 0 only (stderr, or stdout with err=False)."""
    if comm.rank == 0:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


def say_note(comm, note: str) -> None:
    """``say_once`` of a ``deepfusion: note:`` line, nothing when ``note`` is empty (the
    setters that return a note only when there is something to say)."""
    if note:
        say_once(comm, f"deepfusion: note: {note}")


def run_local(fn, args) -> int:
    """A one-process command: an input error is one line and exit 2."""
    try:
        return fn(args)
    except INPUT_ERRORS as e:
        print(f"deepfusion: error: {e}", file=sys.stderr)
        return ExitCode.INPUT


def run_distributed(fn, args) -> int:
    """Run ``fn(args, comm)`` on COMM_WORLD under the policy. Python warnings are shown by rank 0
    only: every rank runs the same code on the same shapes, so they would repeat P times."""
    from deepfusion.engine.run import stop
    from deepfusion.engine.parallel.comm import launcher_mismatch, world

    try:
        with stop.starting():  # MPI_Init: a watchdog ends a rank whose peers never join
            comm = world()
    except ValueError as e:  # a malformed DEEPFUSION_START_TIMEOUT / _STOP_DEADLINE
        print(f"deepfusion: error: {e}", file=sys.stderr, flush=True)
        return ExitCode.INPUT
    wrong = launcher_mismatch(comm)
    if wrong:
        print(f"deepfusion: error: {wrong}", file=sys.stderr, flush=True)
        return ExitCode.INPUT
    if comm.rank != 0:
        warnings.filterwarnings("ignore")
    from deepfusion.app.agreement import launch_disagreement  # the first collective: same command everywhere

    with stop.starting():  # a process that joined MPI but runs another program never comes
        differ = launch_disagreement(comm, args)
    if differ:
        say_once(comm, f"deepfusion: error: {differ}")
        return ExitCode.INPUT
    return run_guarded(fn, args, comm)


def run_guarded(fn, args, comm) -> int:
    """Run a distributed command ``fn(args, comm)`` under the policy of the module docstring."""
    try:
        return fn(args, comm)
    except InputError as e:
        say_once(comm, f"deepfusion: error: {e}")
        return ExitCode.INPUT
    except Preempted as e:
        say_once(comm, f"deepfusion: {e}")
        return ExitCode.PREEMPTED
    except (NonFiniteLoss, ParametersDiverged) as e:
        say_once(comm, f"deepfusion: error: {e}")
        return ExitCode.NONFINITE
    except BaseException as e:  # noqa: BLE001 - any other failure must end every rank
        if isinstance(e, SystemExit) and not e.code:
            raise
        print(f"deepfusion: error on rank {comm.rank}: {type(e).__name__}: {e}", file=sys.stderr)
        traceback.print_exc()
        if comm.size > 1:
            comm.abort(ExitCode.ABORT)
        return ExitCode.ABORT
