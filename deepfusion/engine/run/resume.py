"""What ``train --resume`` continues from: the newest checkpoint of the run directory that
loads, and the one wording of its refusal when none does (the launch and its checks alike)."""
from __future__ import annotations

from deepfusion.engine.checkpoint import store as ckpt
from deepfusion.engine.errors import InputError
from deepfusion.engine.run.identity import other_run


def resume_refusal(run_dir, exc) -> InputError:
    """``train --resume``'s refusal when no checkpoint of ``run_dir`` loads (``exc``: the
    CheckpointError naming every file tried): one wording for the launch and its checks."""
    return InputError(f"--resume {run_dir}: {exc}; start over in it with --overwrite (without "
                      f"--resume), or in another directory with --set run.dir=PATH")


def newest_loadable(run_dir) -> str:
    """The checkpoint ``train --resume`` would start from (the newest that loads), or its
    refusal (:func:`resume_refusal`) when none does."""
    try:
        path, state, _ = ckpt.load_latest(run_dir)
    except ckpt.CheckpointError as exc:
        raise resume_refusal(run_dir, exc) from None
    check_own(run_dir, path, state["meta"])
    return path


def check_own(run_dir, path: str, meta: dict) -> None:
    """ValueError unless the checkpoint ``path`` (its ``meta``) was written by the run of
    ``run_dir`` (its ``run_id``, else the id its records carry; a run of an earlier version
    with neither takes any): a resume continues its own run only."""
    ids = other_run(run_dir, meta)
    if ids:
        (ours, theirs), where = ids, (meta.get("config") or {}).get("run", {}).get("dir", "?")
        raise ValueError(f"--resume {run_dir}: {path} was written by another run (id {theirs}, "
                         f"run.dir {where!r}), not by this one (id {ours}): a resume continues "
                         f"its own run only. Remove that file to resume from this run's own "
                         f"checkpoints, or start a new run from its weights on purpose: "
                         f"deepfusion train CONFIG --set model.init_from={path} "
                         f"--set run.dir=NEW_DIR")
