"""The stepper interface every optimiser implements, Adam/SGD/LAMB behind it, and the learning-rate
schedules. L-BFGS implements the same interface in :mod:`~deepfusion.engine.train.lbfgs`; one function,
:func:`deepfusion.engine.train.optimizer.build_stepper`, builds any of them.

A stepper takes one optimiser step on a local batch and returns the global
:class:`~deepfusion.engine.train.step.StepResult` with the learning rate it used. The schedule is a
pure function of the global step, so a resumed run recomputes the same learning rate without
storing scheduler state.
"""
from __future__ import annotations

import abc
import math
import time

from deepfusion.engine.parallel.data import LazyBatch
from deepfusion.engine.train.firstorder import SGD, Adam, Lamb
from deepfusion.engine.train.step import LossAndGrad, StepResult

SCHEDULES = ("constant", "cosine", "step", "exponential")
FIRST_ORDER = ("adam", "sgd", "lamb")


class Stepper(abc.ABC):
    """One optimiser behind one interface: ``step``, ``state_dict``, ``load_state_dict``."""

    name: str = ""

    def __init__(self, optimizer, cfg, loss_and_grad: LossAndGrad):
        self.optimizer, self.cfg, self.lg = optimizer, cfg, loss_and_grad

    @abc.abstractmethod
    def step(self, batch: LazyBatch, *, step: int, schedule_steps: int,
             lr_scale: float) -> StepResult:
        """One optimiser step on ``batch`` at global ``step`` of a schedule of
        ``schedule_steps``, with the learning rate scaled by ``lr_scale`` (rollbacks). Skips
        the update when the global loss or gradient is not finite."""

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
        self.lg.gs.check_views()  # loading must not replace a .grad view

    def _set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr


class FirstOrderStepper(Stepper):
    """Adam, SGD or LAMB: one global loss-and-gradient, clip (``optim.grad_clip``), step."""

    def __init__(self, name: str, params, cfg, loss_and_grad: LossAndGrad):
        self.name = name
        if name == "adam":   # not torch.optim: see firstorder (start-up time)
            opt = Adam(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
        elif name == "sgd":
            opt = SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        elif name == "lamb":  # weight decay decoupled, as in the paper: see firstorder.Lamb
            opt = Lamb(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
        else:
            raise ValueError(f"{name!r} is not a first-order optimiser; valid: "
                             f"{', '.join(FIRST_ORDER)}")
        super().__init__(opt, cfg, loss_and_grad)

    def step(self, batch, *, step, schedule_steps, lr_scale):
        t0 = time.perf_counter()
        x = batch.materialize()
        t1 = time.perf_counter()
        lr = lr_at(step, schedule_steps, self.cfg) * lr_scale
        self._set_lr(lr)
        res = self.lg(x)
        t2 = time.perf_counter()
        if res.finite:
            self.lg.gs.clip_(self.cfg.grad_clip, res.grad_norm)
            self.optimizer.step()
        res.times.update(data=t1 - t0, optimizer=time.perf_counter() - t2)
        res.lr = lr
        return res


def lr_at(step, total_steps: int, cfg) -> float:
    """Learning rate at ``step`` (0-based; a float where the schedule was re-planned:
    :mod:`.schedule`) of ``total_steps``: linear warm-up, then the schedule named by
    ``cfg.schedule``. ``total_steps`` 0: not decided yet (a time budget's first steps), the
    rate holds at ``optim.lr`` after the warm-up."""
    base = cfg.lr
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return base * (step + 1) / cfg.warmup_steps
    if total_steps <= 0:
        return base
    s = step - cfg.warmup_steps
    span = max(1, total_steps - cfg.warmup_steps)
    if cfg.schedule == "constant":
        return base
    if cfg.schedule == "cosine":
        return cfg.min_lr + 0.5 * (base - cfg.min_lr) * (1 + math.cos(math.pi * min(s, span) / span))
    if cfg.schedule == "step":
        return max(cfg.min_lr, base * cfg.gamma ** (s // max(1, cfg.step_size)))
    if cfg.schedule == "exponential":
        return max(cfg.min_lr, base * cfg.gamma ** (s / span))
    raise ValueError(f"optim.schedule = {cfg.schedule!r}; valid: {', '.join(SCHEDULES)}")
