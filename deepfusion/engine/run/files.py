"""The files DeepFusion writes in a run directory, and ``--overwrite``'s clearing of them.

``--overwrite`` replaces a run, not a directory: it removes what a run wrote (its config,
metrics, checkpoints, reports, figures, compile cache, temporary files) and refuses, naming
them, when anything else is there (a user's notes, another tool's output), so that nothing of
the user's is ever deleted by a start.
"""
from __future__ import annotations

import fnmatch
import os
import shutil

from deepfusion.engine.run.identity import RUN_ID
from deepfusion.engine.run.lock import LOCK_NAME
from deepfusion.engine.run.log import REJECTED

WRITTEN = (RUN_ID, "config.toml", "metrics.jsonl", REJECTED, "checkpoints", "eval.json", "eval.png",
           "loss.png", "progress.png", "compile_cache", "eval_seed*.json", "*.tmp.*", LOCK_NAME,
           LOCK_NAME + ".*")


def written_by_a_run(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in WRITTEN)


# what a run writes in checkpoints/: its step files and their temporaries while written
CHECKPOINT_FILES = ("step_*.h5", "step_*.h5.tmp.*")


def foreign(run_dir: str) -> list[str]:
    """The names in ``run_dir``, and in its ``checkpoints/``, that no run writes (sorted)."""
    others = [n for n in os.listdir(run_dir) if not written_by_a_run(n)]
    where = os.path.join(run_dir, "checkpoints")
    if os.path.isdir(where) and not os.path.islink(where):
        others += [os.path.join("checkpoints", n) for n in os.listdir(where)
                   if not any(fnmatch.fnmatch(n, p) for p in CHECKPOINT_FILES)
                   or not os.path.isfile(os.path.join(where, n))]
    return sorted(others)


def check_overwrite(run_dir: str) -> None:
    """ValueError naming the files ``--overwrite`` would not remove, if there are any."""
    others = foreign(run_dir)
    if others:
        shown = ", ".join(others[:8]) + (f" and {len(others) - 8} more" if len(others) > 8 else "")
        raise ValueError(f"--overwrite replaces the run in {run_dir!r}, but it also holds files "
                         f"no run writes: {shown}. Move them out of the directory (or choose "
                         f"another one with --set run.dir=PATH) and start again; --overwrite "
                         f"removes only what a run wrote")


def clear_run_dir(run_dir: str) -> None:
    """Remove what a run wrote in ``run_dir`` but its lock (``--overwrite``, under the lock,
    after :func:`check_overwrite`)."""
    for name in os.listdir(run_dir):
        if name == LOCK_NAME or name.startswith(LOCK_NAME + ".") or not written_by_a_run(name):
            continue
        p = os.path.join(run_dir, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.unlink(p)
