"""Which optimiser steps when: the one function that builds any stepper, and the schedule
of ``optim.name`` / ``optim.switch_to_lbfgs_epoch`` (Adam, SGD or LAMB, then L-BFGS from an
epoch).

The active stepper depends only on the epoch, so all ranks switch at the same step, and a
checkpoint records the active stepper's name so a resume or rollback rebuilds the same one.
"""
from __future__ import annotations

from deepfusion.engine.train.lbfgs import LBFGSStepper
from deepfusion.engine.train.stepper import FIRST_ORDER, FirstOrderStepper, Stepper
from deepfusion.engine.train.step import LossAndGrad

STEPPERS = FIRST_ORDER + ("lbfgs",)


def build_stepper(name: str, params, cfg, loss_and_grad: LossAndGrad) -> Stepper:
    """The stepper ``name`` (one of :data:`STEPPERS`) over ``params`` from an ``[optim]``
    section."""
    if name == "lbfgs":
        return LBFGSStepper(params, cfg, loss_and_grad)
    if name in FIRST_ORDER:
        return FirstOrderStepper(name, params, cfg, loss_and_grad)
    raise ValueError(f"unknown optimiser {name!r}; valid: {', '.join(STEPPERS)}")


class OptimizerSchedule:
    """The stepper active at each epoch; built when first needed, rebuilt on a switch."""

    def __init__(self, params, cfg, loss_and_grad: LossAndGrad):
        self.params, self.cfg, self.lg = list(params), cfg, loss_and_grad
        self.current = build_stepper(self.name_at(0), self.params, cfg, loss_and_grad)

    def name_at(self, epoch: int) -> str:
        c = self.cfg
        if c.name == "lbfgs" or 0 <= c.switch_to_lbfgs_epoch <= epoch:
            return "lbfgs"
        return c.name

    def at(self, epoch: int) -> Stepper:
        """The stepper of ``epoch`` (a fresh L-BFGS from the first step of the switch epoch)."""
        return self.use(self.name_at(epoch))

    def use(self, name: str) -> Stepper:
        if self.current.name != name:
            self.current = build_stepper(name, self.params, self.cfg, self.lg)
        return self.current

    def restore(self, name: str, state: dict) -> None:
        """Make ``name`` (as recorded in a checkpoint) the active stepper with ``state``."""
        self.use(name).load_state_dict(state)
