"""A fixed step time for ``train.time_budget`` runs, through the product's one test hook
(:mod:`deepfusion.engine.run.hook`): ``DEEPFUSION_TEST_HOOK=tests.budget_clock`` and
``DEEPFUSION_STEP_SECONDS="0.5,2"`` (one entry per rank; the last stands for the rest) make
each step of that rank last that many seconds on the budget's clock, so its decision is a
function of the step count alone: tests assert it exactly, whatever the machine's load."""
from __future__ import annotations

import os

from deepfusion.engine.run.hook import ENV as HOOK

ENV = "DEEPFUSION_STEP_SECONDS"


def clock_env(seconds: str) -> dict:
    """The environment of a launch whose ranks' steps take ``seconds`` ("0.5,2")."""
    return {HOOK: __name__, ENV: seconds}


def step_hook(rank: int):
    try:
        values = [float(v) for v in os.environ.get(ENV, "").split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{ENV}={os.environ.get(ENV)!r}: give seconds per rank, e.g. 0.5,2") \
            from None
    if not values:
        raise ValueError(f"{ENV} is not set: give seconds per rank, e.g. 0.5,2")
    dt = values[min(rank, len(values) - 1)]

    def install(trainer):
        budget = trainer.budget
        if budget is not None and getattr(budget, "fixed", False) is False:
            budget.clock = lambda: trainer.step * dt
            budget.t0, budget.fixed = budget.clock(), True
    return install
