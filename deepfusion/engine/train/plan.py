"""The level plan: which grid, batch and optimiser settings every global step trains with.

A run is a sequence of level *visits*. Without ``train.levels`` it is one visit on
``problem.grid`` for ``train.epochs`` (capped by ``train.max_steps``), exactly the single-grid
run (with ``train.time_budget`` its length is decided by the run: :mod:`.budget`). With
``train.levels`` the listed levels are visited as listed (``train.cycle = ""``) or in
a multigrid cycle's order; levels are then listed coarse to fine, 0 the coarsest, n-1 the
finest:

* ``half-v``: 0, 1, ..., n-1 (coarse to fine once: the cheap levels first);
* ``v``: n-1, n-2, ..., 0, 1, ..., n-1 (the finest, down to the coarsest, back up);
* ``f``: the F-cycle, n-1 down to 0, then up to each level j = 1 .. n-1 in turn and down to 0
  again before the next (3 levels: 2 1 0 1 0 1 2).

Every visit trains for its level's length with a fresh optimiser whose learning-rate schedule
runs over the visit (gradients differ in scale between grids, so moments carried from another
grid would be wrong); the weights carry over (the generator is fully convolutional). The data
order continues across visits: visit v's epoch e is pool epoch ``epoch_base + e``, so no two
visits repeat an order. A level with ``prolong`` grows the network on its first visit (the
trainer asks the application to, :class:`~deepfusion.engine.train.trainer.Trainer`); the visit
records the grid the network so far keeps answering on. ``train.max_steps`` cuts the plan (the cut visit's schedule is cut with
it, as a single-grid run's is).

Pure Python: no torch, no PDE, no MPI.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from deepfusion.config.levels import build_levels, level_optim
from deepfusion.engine.train.budget import UNDECIDED


@dataclass(frozen=True)
class Visit:
    """One visit of a level: global steps [start, start + steps)."""

    index: int             # position in the visited sequence
    level: int             # which of train.levels (0 without levels)
    grid: tuple[int, ...]
    start: int
    steps: int
    global_batch: int
    micro_batch: int
    optim: object          # the [optim] section of this visit (OptimConfig)
    epoch_base: int        # pool epochs consumed by earlier visits
    steps_per_epoch: int
    inner_grid: tuple[int, ...] = ()  # set when this visit grows the network (prolong): the
    # grid of the visit before it, where the network so far keeps answering
    train_inner: bool = True  # a growing visit: whether the network so far keeps training
    progress: str = "run"     # what the problem's training progress counts over: run or level
    correction: dict = field(default_factory=dict)  # a growing visit: its correction network's
    # options (model.prolong with the level's correction over it)

    @property
    def grows(self) -> bool:
        return bool(self.inner_grid)

    @property
    def end(self) -> int:
        return self.start + self.steps

    def epoch_of(self, step: int) -> tuple[int, int]:
        """(pool epoch, step within that epoch) of global ``step`` in this visit."""
        e, s = divmod(step - self.start, self.steps_per_epoch)
        return self.epoch_base + e, s

    def describe(self) -> str:
        grid = "x".join(str(g) for g in self.grid)
        grows = (f", prolonging the network from {'x'.join(map(str, self.inner_grid))}"
                 f"{'' if self.train_inner else ' (kept frozen)'}" if self.grows else "")
        return (f"level {self.level} ({grid}), visit {self.index}: steps {self.start}.."
                f"{self.end - 1}, global batch {self.global_batch}{grows}")


def visit_order(n: int, cycle: str) -> list[int]:
    """The level indices visited by ``cycle`` over ``n`` levels listed coarse to fine."""
    top = n - 1
    if cycle in ("", "half-v"):  # as listed; half-v lists them coarse to fine
        return list(range(n))
    if cycle == "v":
        return list(range(top, -1, -1)) + list(range(1, n))
    if cycle == "f":
        order = list(range(top, -1, -1))
        for j in range(1, n):
            order += list(range(1, j + 1))
            if j < top:
                order += list(range(j - 1, -1, -1))
        return order
    raise ValueError(f"unknown train.cycle {cycle!r}; valid: \"\", half-v, v, f")


def plan(cfg, *, cut: bool = True) -> list[Visit]:
    """The visits of the run configured by ``cfg`` (a validated Config), cut at
    ``train.max_steps`` unless ``cut`` is false."""
    d, t = cfg.data, cfg.train
    max_steps = t.max_steps if cut else 0
    if not t.levels:
        spe = d.n_samples // d.global_batch
        # a time budget's count is decided by the run (Trainer): until then, max_steps or none
        total = UNDECIDED if t.time_budget.strip() else t.epochs * spe
        steps = min(total, max_steps) if max_steps > 0 else total
        return [Visit(0, 0, tuple(cfg.problem.grid), 0, steps, d.global_batch, t.micro_batch,
                      cfg.optim, 0, spe)]
    levels = build_levels(t.levels)
    visits, start, epoch_base, seen = [], 0, 0, set()
    for index, k in enumerate(visit_order(len(levels), t.cycle)):
        lv = levels[k]
        # a prolonged level grows the network on its first visit only (config checks it is
        # entered from a coarser level)
        inner = visits[-1].grid if lv.prolong and k not in seen and visits else ()
        correction = {**cfg.model.prolong, **lv.correction} if inner else {}
        seen.add(k)
        batch = lv.global_batch or d.global_batch
        spe = d.n_samples // batch
        steps = lv.steps or lv.epochs * spe
        if max_steps > 0:
            steps = min(steps, max_steps - start)
            if steps <= 0:
                break
        micro = t.micro_batch if lv.micro_batch < 0 else lv.micro_batch
        optim = level_optim(cfg.optim, lv.optim, f"train.levels[{k}]")
        visits.append(Visit(index, k, tuple(lv.grid), start, steps, batch, micro, optim,
                            epoch_base, spe, inner, lv.train_inner, lv.progress, correction))
        start += steps
        epoch_base += -(-steps // spe)
    return visits


def visit_at(visits: list[Visit], step: int) -> Visit:
    """The visit that takes global step ``step`` (0-based; the last visit past the end)."""
    for v in visits:
        if step < v.end:
            return v
    return visits[-1]


def signature(visits: list[Visit]) -> list[list]:
    """What a checkpoint records of the plan, to refuse a resume under a different one."""
    return [[v.level, list(v.grid), v.start, v.steps, v.global_batch] +
            (["prolong"] if v.grows else []) for v in visits]


def growths(visits: list[Visit], upto: int) -> list[int]:
    """Indices of the visits up to ``upto`` (inclusive) that grow the network: the network of
    visit ``upto`` is the built one grown at each of them, in order."""
    return [v.index for v in visits[:upto + 1] if v.grows]

