"""The rule of ``train.on_nonfinite``: what a step with a non-finite loss or gradient says, and
whether the run stops (exit 3) or rolls back to its newest checkpoint with a lower learning
rate (``Trainer.roll_back`` does the reload). Rollbacks to the same checkpoint in a row lower
the rate further, ``train.rollback_lr_factor`` to the power of their count, until the floor
``train.rollback_min_lr_scale``, where the run stops.
"""
from __future__ import annotations

import os

from deepfusion.engine.errors import NonFiniteLoss

STOP_FIX = ("Lower optim.lr, set optim.grad_clip, or set train.on_nonfinite = \"rollback\" to "
            "restart from the last checkpoint.")


def nonfinite_where(res, step: int) -> str:
    """What failed at ``step`` (the step not taken): the loss terms, or the gradient."""
    what = ", ".join(res.nonfinite_terms) if res.nonfinite_terms else "the gradient (grad_norm)"
    return f"non-finite loss at step {step}: term(s) {what}"


def stop_unless_rollback(t, where: str) -> None:
    """NonFiniteLoss, with what to change, unless ``t`` (the train section) rolls back."""
    if t.on_nonfinite != "rollback":
        raise NonFiniteLoss(f"{where}. {STOP_FIX}")


def rollback_scale(t, where: str, path: str, lr_scale: float,
                   rolled_back: tuple[str, int]) -> tuple[float, int]:
    """(learning-rate scale, rollbacks in a row) of a rollback to checkpoint ``path``, written
    with ``lr_scale``; ``rolled_back``: (checkpoint, count) of the rollbacks so far in a row.
    NonFiniteLoss once the scale would fall below the floor."""
    n = rolled_back[1] + 1 if rolled_back[0] == path else 1
    scale = lr_scale * t.rollback_lr_factor ** n
    if scale < t.rollback_min_lr_scale:
        raise NonFiniteLoss(
            f"{where}; still failing after {n - 1} rollback(s) to {os.path.basename(path)} "
            f"(learning-rate scale {scale / t.rollback_lr_factor:g}, floor "
            f"train.rollback_min_lr_scale = {t.rollback_min_lr_scale:g}). Lower optim.lr or "
            f"set optim.grad_clip.")
    return scale, n
