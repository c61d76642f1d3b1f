"""Checkpoints written by earlier versions, read as this version writes them: the one step that
knows what they lack (docs/run-directory.md, "Checkpoints written by earlier versions").

Format version 1 (the first release) recorded no digests, version 2 (the second) one per
dataset; neither is sealed, so :mod:`.store` reads them in a contained check first and verifies
what they did record. Their ``meta`` may lack keys the trainer writes since: :func:`upgrade`
gives each the value its absence meant, once, as the file is loaded, so every reader (resume,
rollback, infer, evaluate, export, ``deepfusion.load``) reads the current layout. A file of the
current version is returned as written.
"""
from __future__ import annotations

# meta keys a file of an earlier version may lack -> the value their absence meant
EARLIER_META = {
    "optimizer": None,       # the stepper the schedule names at the checkpoint's epoch
    "schedule_steps": None,  # the learning-rate schedule's length: the resumed run's own
    "visit": 0,              # a single-grid run: one visit, level 0
    "level": 0,
    "elapsed_s": 0.0,        # no trajectory time recorded: counted from the resume
    "plan": None,            # no level plan to resume under
}


def upgrade(state: dict, version: int, current: int) -> dict:
    """``state`` as loaded from a file of format ``version``, in the layout of format
    ``current``: the meta keys an earlier version did not write, with the values their
    absence meant (:data:`EARLIER_META`; ``grid``, the grid trained on, is the problem's)."""
    if version >= current:
        return state
    meta = state["meta"]
    for key, value in EARLIER_META.items():
        meta.setdefault(key, value)
    if "grid" not in meta:
        problem = meta.get("problem") or {}
        meta["grid"] = (problem.get("kwargs") or {}).get("grid")
    return state
