"""Optimisers and learning-rate schedules (first-order; L-BFGS lives in lbfgs.py).

The schedule is a pure function of the global step, so a resumed run recomputes the same
learning rate without storing scheduler state.
"""
from __future__ import annotations

import math

import torch

OPTIMIZERS = ("adam", "sgd", "lbfgs")
SCHEDULES = ("constant", "cosine", "step", "exponential")


def build_optimizer(params, cfg):
    """Adam or SGD from an ``optim`` config section (L-BFGS is built by lbfgs.build)."""
    if cfg.name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, betas=tuple(cfg.betas),
                                weight_decay=cfg.weight_decay, foreach=True)
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum,
                               weight_decay=cfg.weight_decay, foreach=True)
    raise ValueError(f"optim.name = {cfg.name!r} is not a first-order optimiser; valid: adam, sgd")


def lr_at(step: int, total_steps: int, cfg) -> float:
    """Learning rate at global ``step`` (0-based) of ``total_steps``: linear warm-up, then the
    schedule named by ``cfg.schedule``."""
    base = cfg.lr
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return base * (step + 1) / cfg.warmup_steps
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


def set_lr(optimizer, lr: float):
    for g in optimizer.param_groups:
        g["lr"] = lr
