"""``[[train.levels]]``: the grids a multigrid schedule trains through, and their checks.

A level is one table of the ``train.levels`` array::

    [[train.levels]]
    grid = [128, 128]          # the node grid of this level
    epochs = 20                # its length: epochs (passes over the pool) or steps, not both
    global_batch = 32          # optional: 0 = data.global_batch
    micro_batch = 8            # optional: -1 = train.micro_batch
    optim = {lr = 4e-3}        # optional: [optim] keys that differ on this level
    prolong = true             # optional: carry the network so far to this grid (see below)
    train_inner = false        # optional, with prolong: train only the new correction network
    correction = {base_width = 8}  # optional, with prolong: this level's model.prolong changes
    progress = "level"         # optional: the problem's homotopy restarts on this level

``train.cycle`` says how the listed levels are visited: ``""`` exactly as listed, or one of the
multigrid cycle names, for which the levels are listed coarse to fine and the visit order is
expanded by the engine (``deepfusion.engine.train.plan``). ``prolong = true`` on a level makes the
network trained so far the inner part of a new, larger one on this level's grid (the model's
``prolong`` construction, options ``model.prolong``); it needs a level visited first from a
coarser one (half-V or as listed, never the first). Every check here names the level
(``train.levels[1].grid``) and the fix. Pure Python: no PDE, no model, no MPI.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from deepfusion.config.schema import ConfigError, Section, describe_value, option

CYCLES = ("", "half-v", "v", "f")


@dataclass(kw_only=True)
class LevelConfig(Section):
    """One level of a multigrid schedule (a table of ``train.levels``)."""

    _section: ClassVar[str] = "train.levels[i]"

    grid: list[int] = option([], "node grid [H, W] (3-D: [D, H, W]) of this level", item_ge=4,
                             max_len=3)
    steps: int = option(0, "optimiser steps on this level (or give epochs)", ge=0)
    epochs: int = option(0, "passes over the sample pool on this level (or give steps)", ge=0)
    global_batch: int = option(0, "samples per step on this level; 0 = data.global_batch", ge=0)
    micro_batch: int = option(-1, "samples per forward/backward on this level; -1 = "
                                  "train.micro_batch", ge=-1)
    optim: dict[str, Any] = option({}, "[optim] keys that differ on this level, e.g. "
                                       "{lr = 1e-3, warmup_steps = 0}; the learning-rate "
                                       "schedule runs over the level's own length")
    prolong: bool = option(False, "grow the network on entering this level: the network so "
                                  "far answers on the previous level's grid, interpolated, "
                                  "plus a new correction network on this grid (model.prolong)")
    train_inner: bool = option(True, "with prolong = true: whether the network so far keeps "
                                     "training; false trains only the new correction (the "
                                     "network so far keeps its weights and runs without "
                                     "gradients)")
    correction: dict[str, Any] = option({}, "with prolong = true: options of the correction "
                                            "network this level adds that differ from "
                                            "model.prolong, e.g. {base_width = 8, max_width = "
                                            "32} (a cheaper network on the finest grid)")
    progress: str = option("run", "what the problem's training progress (a loss homotopy such "
                                  "as an annealed smoothing) counts over on this level: "
                                  "\"run\" (the whole run) or \"level\" (from 0 at the start "
                                  "of each visit of this level to 1 at its end)",
                           choices=("run", "level"))

    def _validate(self):
        if not self.grid:
            raise self._err("grid", "is missing: give each level its node grid, e.g. "
                                    "grid = [128, 128]")
        if (self.steps > 0) == (self.epochs > 0):
            what = "both" if self.steps > 0 else "neither"
            raise self._err("steps", f"and .epochs: give exactly one length > 0 (got {what}: "
                                     f"steps = {self.steps}, epochs = {self.epochs}); a level "
                                     f"of zero length trains nothing")


def level_section(i: int) -> type[LevelConfig]:
    """LevelConfig whose error messages name ``train.levels[i]`` (a subclass per position:
    the key is a class attribute read by the generic checks)."""
    return type(f"LevelConfig{i}", (LevelConfig,), {"_section": f"train.levels[{i}]"})


def build_levels(tables) -> list[LevelConfig]:
    """Validated LevelConfig objects from the raw ``train.levels`` list of tables."""
    if not isinstance(tables, (list, tuple)):
        raise ConfigError(f"train.levels must be an array of tables ([[train.levels]]), "
                          f"{describe_value(tables)}", key="train.levels")
    out = []
    names = {f.name for f in dataclasses.fields(LevelConfig)}
    for i, table in enumerate(tables):
        key = f"train.levels[{i}]"
        if not isinstance(table, dict):
            raise ConfigError(f"{key} must be a table, {describe_value(table)}", key=key)
        bad = sorted(k for k in table if k not in names)
        if bad:
            raise ConfigError(f"unknown key(s) {bad} in {key}; valid keys: {sorted(names)}",
                              key=f"{key}.{bad[0]}")
        out.append(level_section(i)(**table))
    return out


def check_levels(cfg) -> None:
    """The checks that need other sections: grids against ``problem.grid``, batches against
    the pool, each level's optim overrides as a valid ``[optim]``, the cycle's ordering."""
    levels, t = build_levels(cfg.train.levels), cfg.train
    if not levels:
        if t.cycle:
            raise ConfigError(f"train.cycle = {t.cycle!r} needs train.levels: list the grids "
                              f"coarse to fine as [[train.levels]] tables", key="train.cycle")
        return
    dims = len(cfg.problem.grid)
    for i, lv in enumerate(levels):
        key = f"train.levels[{i}]"
        if len(lv.grid) != dims:
            raise ConfigError(f"{key}.grid = {lv.grid} has {len(lv.grid)} axes but problem.grid "
                              f"= {cfg.problem.grid} has {dims}", key=f"{key}.grid")
        batch = lv.global_batch or cfg.data.global_batch
        if batch > cfg.data.n_samples:
            raise ConfigError(f"{key}.global_batch = {batch} exceeds data.n_samples = "
                              f"{cfg.data.n_samples}; the pool must hold one batch",
                              key=f"{key}.global_batch")
        level_optim(cfg.optim, lv.optim, key)
    if list(levels[-1].grid) != list(cfg.problem.grid):
        raise ConfigError(f"the last level trains on {levels[-1].grid} but problem.grid = "
                          f"{cfg.problem.grid}: problem.grid is the grid the trained model "
                          f"answers on and is evaluated on; set problem.grid = "
                          f"{levels[-1].grid}", key="problem.grid")
    if t.cycle:
        check_coarse_to_fine(levels, t.cycle)
    check_prolong(levels, t.cycle)
    check_frozen(levels)


def check_prolong(levels, cycle: str) -> None:
    """A prolonged level is entered from a coarser one, once: the first level listed has
    nothing to grow from, and the V and F cycles start on the finest level."""
    grown = [i for i, lv in enumerate(levels) if lv.prolong]
    if not grown:
        return
    key = f"train.levels[{grown[0]}].prolong"
    if cycle in ("v", "f"):
        raise ConfigError(f"{key} = true needs the level entered from a coarser one, but "
                          f"train.cycle = {cycle!r} starts on the finest level; use "
                          f"train.cycle = \"half-v\" or list the levels in visiting order",
                          key=key)
    for i in grown:
        key = f"train.levels[{i}].prolong"
        if i == 0:
            raise ConfigError(f"{key} = true on the first level: there is no coarser network "
                              f"to prolong; set it on the later levels only", key=key)
        earlier = levels[:i]
        if not all(all(g > e for g, e in zip(levels[i].grid, lv.grid)) for lv in earlier):
            raise ConfigError(f"{key} = true needs train.levels[{i}].grid = {levels[i].grid} "
                              f"finer on every axis than every level before it "
                              f"({[lv.grid for lv in earlier]})", key=key)


def check_frozen(levels) -> None:
    """``correction`` and ``train_inner = false`` need a level that grows; the latter freezes
    the network so far inside the grown one, so no later level may be on a coarser grid, where
    the frozen network would answer alone and nothing would train."""
    for i, lv in enumerate(levels):
        if lv.correction and not lv.prolong:
            key = f"train.levels[{i}].correction"
            raise ConfigError(f"{key} = {lv.correction} needs prolong = true on that level (only "
                              f"a grown network has a correction network); drop correction or "
                              f"set train.levels[{i}].prolong = true", key=key)
        if lv.train_inner:
            continue
        key = f"train.levels[{i}].train_inner"
        if not lv.prolong:
            raise ConfigError(f"{key} = false needs prolong = true on that level (only a grown "
                              f"network has a network so far to freeze); drop train_inner or "
                              f"set train.levels[{i}].prolong = true", key=key)
        for j, later in enumerate(levels[i + 1:], start=i + 1):
            if any(g < f for g, f in zip(later.grid, lv.grid)):
                raise ConfigError(f"{key} = false, but train.levels[{j}].grid = {later.grid} "
                                  f"is coarser than {lv.grid}: there the frozen network "
                                  f"answers alone and nothing trains; keep train_inner = true "
                                  f"or drop the coarser later level", key=key)


def check_coarse_to_fine(levels, cycle: str) -> None:
    if len(levels) < 2:
        raise ConfigError(f"train.cycle = {cycle!r} needs at least two levels, got "
                          f"{len(levels)}", key="train.levels")
    for i in range(1, len(levels)):
        a, b = levels[i - 1].grid, levels[i].grid
        if not all(y > x for x, y in zip(a, b)):
            raise ConfigError(f"train.cycle = {cycle!r} visits the levels in its own order, so "
                              f"they are listed coarse to fine, each finer on every axis: "
                              f"train.levels[{i}].grid = {b} is not finer than "
                              f"train.levels[{i - 1}].grid = {a}", key=f"train.levels[{i}].grid")


def level_optim(base, overrides: dict, key: str):
    """The ``[optim]`` section of a level: ``base`` with ``overrides``, validated as a whole
    (errors name the level's key)."""
    names = {f.name for f in dataclasses.fields(base)}
    bad = sorted(k for k in overrides if k not in names)
    if bad:
        raise ConfigError(f"unknown [optim] key(s) {bad} in {key}.optim; valid keys: "
                          f"{sorted(names)}", key=f"{key}.optim")
    try:
        return dataclasses.replace(base, **overrides)
    except ConfigError as exc:
        raise ConfigError(f"{key}.{exc}", key=f"{key}.{exc.key}") from None
