"""Where a command may write: the one check of an output path, made before the command's work.

A command that writes (``infer``/``solve --out``, ``evaluate --out``, ``export --out``,
``compare --out``, the ``jobs`` tools' ``--out``) asks :func:`check_output` (a file) or
:func:`check_output_dir` (a directory it writes into) first, so that a wrong path is one line
and exit 2 before any model is loaded or any evaluation runs, and so that no command ever
writes over its own inputs, a run's checkpoint or a file a run keeps (its config, metrics,
lock: :data:`deepfusion.engine.run.files.WRITTEN`): those would be lost, or read back later as
something they are not (a fields file as the newest checkpoint).

Only the file system is asked (no torch, no MPI): each message names the flag, what is wrong
and the fix.
"""
from __future__ import annotations

import fnmatch
import glob
import os

from deepfusion.engine.run.files import written_by_a_run

CHECKPOINTS = "checkpoints"
# what a run directory holds for sure once a run has started in it (a user's directory that
# merely has a file called metrics.jsonl is not taken for a run)
RUN_MARKS = ("config.toml", CHECKPOINTS)


def check_output(path: str, *, flag: str, inputs=(), run_dirs=(), allow=()) -> None:
    """ValueError unless ``path`` is a file this command may write: its directory exists and
    is writable, it is not a directory, not one of ``inputs`` (paths; None skipped), not in a
    run's ``checkpoints/`` and not a file a run writes (in a run directory: one of ``run_dirs``,
    or one that looks like a run), unless its name matches a pattern of ``allow``."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a directory: give the file to write, e.g. "
                         f"{os.path.join(path, 'out' + (os.path.splitext(path)[1] or '.h5'))}")
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path}: the directory {folder} does not exist; create it or "
                         f"choose another")
    _refuse_input(path, flag, inputs)
    _refuse_run_file(path, flag, run_dirs, allow)
    if not os.access(folder, os.W_OK | os.X_OK) or (
            os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"{flag} {path}: not writable (the file or its directory {folder}); "
                         f"choose another place")


def check_output_dir(path: str, *, flag: str, create: bool = False, run_dirs=()) -> None:
    """ValueError unless ``path`` is a directory this command may write into: an existing,
    writable directory (with ``create``: or one it may make, under a writable one), not a
    run's ``checkpoints/`` nor inside it."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a file, not a directory: give the directory to "
                         f"write into")
    if not os.path.isdir(path) and not create:
        raise ValueError(f"{flag} {path}: the directory does not exist; create it or choose "
                         f"another")
    _refuse_run_file(os.path.join(path, "x"), flag, run_dirs, ())
    here = os.path.abspath(path)
    while not os.path.exists(here):  # the directory made, or its nearest existing ancestor
        here = os.path.dirname(here)
    if not os.path.isdir(here):
        raise ValueError(f"{flag} {path}: {here} is a file, so the directory cannot be made; "
                         f"choose another")
    if not os.access(here, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: the directory {here} is not writable; choose another")


def checkpoint_paths(checkpoint: str) -> tuple[tuple, tuple]:
    """(inputs, run directories) of a command's CHECKPOINT argument (a checkpoint file or a run
    directory), for :func:`check_output`."""
    if os.path.isdir(checkpoint):
        return (), (checkpoint,)
    folder = os.path.dirname(os.path.abspath(checkpoint))
    runs = (os.path.dirname(folder),) if os.path.basename(folder) == CHECKPOINTS else ()
    return (checkpoint,), runs


def _same(a: str, b: str) -> bool:
    if os.path.exists(a) and os.path.exists(b):
        return os.path.samefile(a, b)  # links and hard links too
    return os.path.realpath(a) == os.path.realpath(b)


def _refuse_input(path: str, flag: str, inputs) -> None:
    for given in inputs:
        if given and _same(path, given):
            raise ValueError(f"{flag} {path} is one of this command's inputs ({given}): "
                             f"writing it would destroy what is being read; choose another file")


def _looks_like_run(folder: str, run_dirs) -> bool:
    if any(os.path.isdir(r) and _same(folder, r) for r in run_dirs):
        return True
    return all(os.path.exists(os.path.join(folder, m)) for m in RUN_MARKS)


def _refuse_run_file(path: str, flag: str, run_dirs, allow) -> None:
    """ValueError if ``path`` is in a run's checkpoints/ or is a file its run directory keeps."""
    real = os.path.realpath(path)
    folder, name = os.path.split(real)
    parts = real.split(os.sep)
    for i in range(len(parts) - 1, 0, -1):  # a checkpoints/ anywhere above, of a run
        if parts[i] != CHECKPOINTS:
            continue
        run, ckpts = os.sep.join(parts[:i]) or os.sep, os.sep.join(parts[:i + 1])
        if _looks_like_run(run, run_dirs) or glob.glob(os.path.join(ckpts, "step_*.h5")):
            raise ValueError(f"{flag} {path} is inside the checkpoints directory of the run "
                             f"{run}: a file there is taken for a checkpoint (or overwrites "
                             f"one); write outside {ckpts}")
    if (_looks_like_run(folder, run_dirs) and written_by_a_run(name)
            and not any(fnmatch.fnmatch(name, p) for p in allow)):
        raise ValueError(f"{flag} {path} is a file the run in {folder} writes and reads "
                         f"({name}); choose another name or directory")
