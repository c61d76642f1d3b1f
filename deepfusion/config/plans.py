"""Plans from one setting: ``train.coarse_to_fine`` written out as ``train.levels``, and the
``train.time_budget`` text read as seconds.

``train.coarse_to_fine = K`` (K >= 2) is a multigrid schedule of K levels ending on
``problem.grid``, expanded here when the config is resolved, so ``deepfusion config`` prints
the levels, the checkpoints record them and the engine sees an ordinary ``train.levels``:

* **grids**: each level halves the next finer one per axis (an even node count n -> n / 2, as
  the recipes' 64 -> 128 -> 256; an odd one n -> (n + 1) / 2, the nested nodes of 65 -> 33);
* **steps**: the single-grid run's length, ``train.epochs`` passes over the pool, split 2:1
  from each level to the next finer one (K = 3: 4/7, 2/7, 1/7). A coarse step costs a quarter
  of the next finer one in 2-D (an eighth in 3-D), so every coarser level takes at most half
  the wall time of the one above it: the plan costs less than twice its finest level while
  most of its steps are cheap ones (K = 2 puts 2/3 of them on the coarse grid, about what the
  two-level recipes of configs/recipes put there);
* **transfer**: every finer level grows the network (``prolong``): the network so far keeps
  answering on its grid and a new correction network, whose last layer starts at zero,
  learns the rest, so the fine level starts exactly at the interpolated coarse answer. It
  works for any problem (a plugin needs nothing more than its input and output channels);
* **optimiser**: each finer level a fresh one at half the learning rate of the level below
  and no warm-up (the recipes lower the rate on their prolonged levels and start them without
  one); ``optim.min_lr`` is capped at that rate.

A config that gives ``train.levels`` too is accepted only if they are the expansion (the
resolved config a run directory records reads back); otherwise it is refused, naming both
ways out. Pure Python: no PDE, no model, no MPI.
"""
from __future__ import annotations

import dataclasses
import re

from deepfusion.config.levels import build_levels
from deepfusion.config.schema import ConfigError

MIN_NODES = 4  # a level's grid, like problem.grid, has at least 4 nodes per axis


def coarser(n: int) -> int:
    """The node count of the grid one level below ``n`` nodes."""
    return n // 2 if n % 2 == 0 else (n + 1) // 2


def coarse_to_fine_grids(grid, k: int) -> list[list[int]]:
    """The ``k`` grids of the plan, coarsest first, the last ``grid``."""
    grids = [list(grid)]
    for _ in range(k - 1):
        grids.insert(0, [coarser(n) for n in grids[0]])
    return grids


def split_steps(total: int, k: int) -> list[int]:
    """``total`` steps over ``k`` levels, each coarser level twice the next finer one's share;
    the finest takes what rounding leaves, so they add up to ``total``."""
    parts = 2 ** k - 1
    steps = [total * 2 ** (k - 1 - i) // parts for i in range(k - 1)]
    return steps + [total - sum(steps)]


def coarse_to_fine_levels(cfg) -> list[dict]:
    """The ``train.levels`` tables ``train.coarse_to_fine`` stands for (see the module)."""
    t, k = cfg.train, cfg.train.coarse_to_fine
    key = "train.coarse_to_fine"
    if t.cycle not in ("", "half-v"):
        raise ConfigError(f"{key} = {k} visits its levels once, coarse to fine, growing the "
                          f"network on each; train.cycle = {t.cycle!r} starts on the finest "
                          f"level: set train.cycle = \"half-v\" (or \"\"), or list the levels "
                          f"by hand", key=key)
    grids = coarse_to_fine_grids(cfg.problem.grid, k)
    if min(grids[0]) < MIN_NODES:
        fit = 1
        while min(coarse_to_fine_grids(cfg.problem.grid, fit + 1)[0]) >= MIN_NODES:
            fit += 1
        raise ConfigError(f"{key} = {k} halves problem.grid = {cfg.problem.grid} {k - 1} times, "
                          f"down to {grids[0]}: fewer than {MIN_NODES} nodes on an axis; use "
                          f"at most {fit} levels on this grid", key=key)
    total = t.epochs * (cfg.data.n_samples // cfg.data.global_batch)
    if total < 2 ** k - 1:
        raise ConfigError(f"{key} = {k} splits the run's {total} steps (train.epochs = "
                          f"{t.epochs} x {cfg.data.n_samples // cfg.data.global_batch} steps "
                          f"per epoch) 2:1 from level to level, which needs at least "
                          f"{2 ** k - 1}: raise train.epochs or lower {key}", key=key)
    levels = []
    for i, (grid, steps) in enumerate(zip(grids, split_steps(total, k))):
        level = {"grid": grid, "steps": steps}
        if i > 0:
            lr = cfg.optim.lr / 2 ** i
            optim = {"lr": lr, "warmup_steps": 0}
            if cfg.optim.min_lr > lr:
                optim["min_lr"] = lr
            level.update(prolong=True, optim=optim)
        levels.append(level)
    return levels


def expand_coarse_to_fine(cfg) -> None:
    """Write ``train.levels`` from ``train.coarse_to_fine`` (K >= 2), in place; refuse levels
    given by hand that are not the expansion. A no-op for K < 2."""
    t = cfg.train
    if t.coarse_to_fine < 2:
        return
    made = coarse_to_fine_levels(cfg)
    if t.levels and _resolved(t.levels) != _resolved(made):
        raise ConfigError(
            f"train.coarse_to_fine = {t.coarse_to_fine} writes train.levels itself ({made}), "
            f"but train.levels is given as well, differently ({t.levels}). Drop train.levels "
            f"to train the one-setting plan (a run directory's config.toml records the "
            f"levels it wrote: remove them from it to plan anew), or set "
            f"train.coarse_to_fine = 0 to train the levels as listed", key="train.levels")
    t.levels = made


def _resolved(tables) -> list[dict]:
    """Level tables with every default filled in: two spellings of one plan compare equal."""
    try:
        return [dataclasses.asdict(lv) for lv in build_levels(tables)]
    except ConfigError:
        return [{"invalid": tables}]


# -- train.time_budget ---------------------------------------------------------------------------

UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([smh])")


def budget_seconds(text: str) -> float:
    """Seconds of a ``train.time_budget``: a number of seconds ("900") or amounts with units
    s, m, h ("15m", "1.5h", "1h30m"). ValueError naming the forms otherwise."""
    s = text.strip().lower()
    try:
        seconds = float(s)
    except ValueError:
        parts = _PART.findall(s)
        if not parts or _PART.sub("", s).strip():
            raise ValueError(f"cannot read {text!r} as a duration: give seconds (900) or "
                             f"amounts with units s, m, h (\"15m\", \"1.5h\", \"1h30m\")") \
                from None
        seconds = sum(float(n) * UNITS[u] for n, u in parts)
    if not seconds > 0 or seconds != seconds or seconds == float("inf"):
        raise ValueError(f"{text!r} is not a positive, finite duration")
    return seconds
