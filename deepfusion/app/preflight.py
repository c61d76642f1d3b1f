"""The checks of a launch that need neither torch nor the network: the batch of every level
against the number of ranks (or domain groups), the precision against this CPU, and the run
directory's state.

``deepfusion train`` runs them on every rank right after reading the config, before torch is
imported: a refused launch (a batch P does not divide, a run directory that already holds a
run) exits in a fraction of a second instead of after each rank's imports (seconds). The checks
that need the problem and the network follow in ``build``; nothing is written until all pass.
"""
from __future__ import annotations

import os

from ..engine import faults
from ..engine.data import check_divisible, group_count
from ..engine.layout import check_precision
from ..engine.levels import plan


def holds_run(d: str) -> bool:
    """Whether directory ``d`` holds a run (its metrics or its checkpoints folder)."""
    return os.path.exists(os.path.join(d, "metrics.jsonl")) or os.path.isdir(os.path.join(d, "checkpoints"))


def check_run(cfg, size: int, resume: bool, overwrite: bool) -> None:
    """Everything about this launch that is not the model: ranks, CPU, run directory, and the
    test-only fault variable (a malformed one is refused here, not at the first step)."""
    faults.parse(os.environ.get(faults.ENV, ""))
    units = data_units(cfg, size)
    for v in plan(cfg):
        try:
            check_divisible(v.global_batch, units)
        except ValueError as e:
            if units != size:
                e = ValueError(f"{e} (here P is the number of data-parallel groups: {size} ranks "
                               f"/ {cfg.parallel.blocks()} blocks per sample)")
            if not cfg.train.levels:
                raise e from None
            raise ValueError(f"train.levels[{v.level}] (grid {list(v.grid)}): {e}") from None
    check_precision(cfg.train.precision)
    d = cfg.run.dir
    if resume and not holds_run(d):
        raise ValueError(f"--resume {d}: no run there (no metrics.jsonl or checkpoints/)")
    if holds_run(d) and not resume and not overwrite:
        raise ValueError(f"run directory {d!r} already holds a run. Continue it with --resume {d}, "
                         f"start over with --overwrite, or choose another with --set run.dir=PATH")


def data_units(cfg, size: int) -> int:
    """How many data-parallel units ``size`` ranks make: the ranks, or under parallel.domain
    the groups of prod(domain) ranks (ValueError if they do not divide evenly)."""
    return group_count(size, cfg.parallel.domain) if cfg.parallel.domain else size
