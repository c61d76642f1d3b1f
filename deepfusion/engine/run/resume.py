"""What ``train --resume`` continues from: the newest checkpoint of the run directory that
loads, and the one wording of its refusal when none does (the launch and its checks alike)."""
from __future__ import annotations

from deepfusion.engine.checkpoint import store as ckpt
from deepfusion.engine.errors import InputError


def resume_refusal(run_dir, exc) -> InputError:
    """``train --resume``'s refusal when no checkpoint of ``run_dir`` loads (``exc``: the
    CheckpointError naming every file tried): one wording for the launch and its checks."""
    return InputError(f"--resume {run_dir}: {exc}; start over in it with --overwrite (without "
                      f"--resume), or in another directory with --set run.dir=PATH")


def newest_loadable(run_dir) -> str:
    """The checkpoint ``train --resume`` would start from (the newest that loads), or its
    refusal (:func:`resume_refusal`) when none does."""
    try:
        return ckpt.load_latest(run_dir)[0]
    except ckpt.CheckpointError as exc:
        raise resume_refusal(run_dir, exc) from None
