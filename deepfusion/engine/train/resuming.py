"""What a resume loads, checks and says besides restoring the state (``Trainer.resume``):
the newest checkpoint (a rollback's too), the level plan it may continue under, the config keys
that changed and what moved the end of the run.

Functions of the config, the checkpoint's ``meta``, the run's log and (loading) the
communicator; no torch of their own.
"""
from __future__ import annotations

import os

from deepfusion.config import config_changes, config_to_dict
from deepfusion.engine.checkpoint import store as ckpt
from deepfusion.engine.errors import InputError


def load_newest(run_dir: str) -> tuple[str, dict, list[str], list[str]]:
    """(path, state, skipped, notes) of the newest loadable checkpoint of ``run_dir``: the
    newer ones skipped, each with why, and notes on the one loaded (no seal); CheckpointError
    when none loads. One process's read: :func:`newest_checkpoint` shares it."""
    notes: list[str] = []
    path, state, skipped = ckpt.load_latest(run_dir, notes)
    return path, state, skipped, notes


def newest_checkpoint(comm, run_dir: str, log, found: list | None = None) -> tuple[str, dict]:
    """(path, state) of the newest loadable checkpoint of ``run_dir`` (a resume's, a
    rollback's), found and read by rank 0 only and broadcast, so every rank restores the same
    state and a file system decision is taken once. ``found``: a list holding rank 0's
    :func:`load_newest` read already, taken out of it (so no caller keeps it). Collective."""
    loaded = error = None
    if comm.rank == 0:
        try:
            path, state, skipped, notes = found.pop() if found else load_newest(run_dir)
            for why in skipped:
                log.warn(f"skipped checkpoint {why}; using {os.path.basename(path)}")
            for note in notes:  # a checkpoint of an earlier DeepFusion, without a seal
                log.warn(note)
            loaded = (path, state)
        except ckpt.CheckpointError as exc:
            error = str(exc)
    loaded, error = comm.bcast_obj((loaded, error))
    if error is not None:
        raise ckpt.CheckpointError(error)
    return loaded


def check_plan(cfg, ours: list, meta: dict, log) -> None:
    """A multigrid run resumes only under the plan it was written with, or under that plan
    extended by further visits after its last (a finished run trained on: the visits so far
    are unchanged, so is the trajectory). ``train.max_steps`` may change: it cuts the plan, it
    does not change it. ``ours``: this config's plan signature (uncut)."""
    if not cfg.train.levels or meta["plan"] is None:
        return
    theirs = meta["plan"]
    if ours[:len(theirs)] != theirs:
        raise InputError(f"--resume {cfg.run.dir}: the checkpoint was written under another "
                         f"level plan ([level, grid, first step, steps, batch] per visit: "
                         f"{theirs}, now {ours}); resume with the run's own "
                         f"train.levels and train.cycle (further levels may follow its "
                         f"last), or start a new run with model.init_from")
    if len(ours) > len(theirs):
        log.info(f"the plan extends the checkpoint's: {len(ours) - len(theirs)} more "
                 f"visit(s) after its {len(theirs)}, from step {ours[len(theirs)][2]}")


def report_changes(cfg, theirs: dict | None, step: int, log) -> None:
    """Name every config key the resume changed (a --set, another config file): the settings
    of a visit not yet trained leave the run so far as it was; anything else changes the
    trajectory from this step. Logged and kept in metrics.jsonl."""
    changes = config_changes(theirs, config_to_dict(cfg)) if theirs else []
    if changes:
        log.info(f"the config differs from the checkpoint's in {len(changes)} key(s): "
                 f"{'; '.join(changes)}")
        log.record({"kind": "resume", "step": step, "config_changes": changes})


def length_change(cfg, meta: dict) -> str:
    """The keys that moved the end of the run since the checkpoint, as the re-plan's log line
    names them ("the step count changed" if none of them did)."""
    theirs = (meta.get("config") or {}).get("train", {})
    moved = [f"train.{k} {theirs[k]} -> {getattr(cfg.train, k)}"
             for k in ("epochs", "max_steps", "time_budget")
             if k in theirs and theirs[k] != getattr(cfg.train, k)]
    return "; ".join(moved) if moved else "the step count changed"


def elastic_note(old: int, new: int) -> str:
    return (f"elastic resume: checkpoint written on P = {old} ranks, continuing on P = {new}; "
            f"the data order and the global batch are unchanged, so the run continues the same "
            f"trajectory")
