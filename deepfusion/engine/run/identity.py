"""A run's identity: a random id written once, at the run's first start, to ``RUN_DIR/run_id``.

Every checkpoint and every record of ``metrics.jsonl`` carries it, and a resume takes only the
checkpoints of its own run: a checkpoint copied in from another run directory would otherwise
continue that run's weights into this run's record, with nothing but a changed seed to show.
"""
from __future__ import annotations

import os
import uuid

RUN_ID = "run_id"


def read_run_id(run_dir: str) -> str | None:
    """The run's id, None if the directory has none (a run of an earlier version, none yet)."""
    try:
        with open(os.path.join(run_dir, RUN_ID)) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def ensure_run_id(run_dir: str) -> str:
    """The run's id, written now if it has none (its first start; a run of an earlier version
    takes one at its first resume)."""
    found = read_run_id(run_dir)
    if found:
        return found
    new = uuid.uuid4().hex[:16]
    with open(os.path.join(run_dir, RUN_ID), "w") as f:
        f.write(new + "\n")
    return new
