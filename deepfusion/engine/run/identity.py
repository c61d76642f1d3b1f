"""A run's identity: a random id written once, at the run's first start, to ``RUN_DIR/run_id``.

Every checkpoint and every record of ``metrics.jsonl`` carries it, and a resume takes only the
checkpoints of its own run: a checkpoint copied in from another run directory would otherwise
continue that run's weights into this run's record, with nothing but a changed seed to show.
"""
from __future__ import annotations

import json
import os
import uuid

RUN_ID = "run_id"
METRICS = "metrics.jsonl"


def read_run_id(run_dir: str) -> str | None:
    """The run's id, None if the directory has none (a run of an earlier version, none yet)."""
    try:
        with open(os.path.join(run_dir, RUN_ID)) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def recorded_run_id(run_dir: str) -> str | None:
    """The id the run's newest record of ``metrics.jsonl`` carries (None: no such record):
    the run's identity where ``run_id`` was deleted, so that a deleted file does not let
    another run's checkpoint in."""
    try:
        with open(os.path.join(run_dir, METRICS), errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("run"), str) and rec["run"]:
            return rec["run"]
    return None


def run_identity(run_dir: str) -> str | None:
    """The run's id: its ``run_id`` file, else the one its records carry (None: neither)."""
    return read_run_id(run_dir) or recorded_run_id(run_dir)


def other_run(run_dir: str, meta: dict) -> tuple[str, str] | None:
    """(this run's id, the writer's) where the checkpoint of ``meta`` was written by another
    run than ``run_dir``'s; None where it is the run's own, or either id is unknown (a run of
    an earlier version)."""
    ours, theirs = run_identity(run_dir), meta.get("run_id")
    return (ours, theirs) if ours and theirs and ours != theirs else None


def ensure_run_id(run_dir: str) -> str:
    """The run's id, written now if it has none: its records' id where ``run_id`` was lost,
    else a new one (its first start; a run of an earlier version takes one at its first
    resume)."""
    found = read_run_id(run_dir)
    if found:
        return found
    new = recorded_run_id(run_dir) or uuid.uuid4().hex[:16]
    with open(os.path.join(run_dir, RUN_ID), "w") as f:
        f.write(new + "\n")
    return new
