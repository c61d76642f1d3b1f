"""Where a visit's learning-rate schedule and training progress stand at each step, and how
they are re-planned when the visit's step count changes.

The schedule (:func:`~deepfusion.engine.train.stepper.lr_at`) and the problem's progress (a
loss homotopy) are functions of the step within the visit and of the schedule's length. A run
whose length never changes evaluates them at the step itself: nothing here touches its
numbers. When the count changes mid-visit (a resume with another ``train.max_steps`` or
``train.epochs``, a ``train.time_budget`` decided or changed) the rest of the visit is
re-planned by a *warp*: from the step k of the change, the steps k .. new end are mapped
linearly onto the schedule's own steps v_k .. length (v_k: where the schedule stood at k), so
the learning rate continues from its value at k and reaches the schedule's end (a cosine's
``optim.min_lr``) on the new last step, with the progress alike. Re-planned again, the warp
is replaced by one from the new step, starting where the old one stood.

A time budget's run does not know its length before it has timed its first steps: its
schedule is *held* (length 0): warm-up runs, then the rate stays at its peak until the count
is decided, and the schedule runs from there to the decided end.

Pure Python: no torch, no MPI.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    """The schedule of the current visit: its ``length`` in steps (0: held, undecided) and,
    once re-planned, the ``warp`` (k, v_k, end): visit steps k .. end run the schedule's steps
    v_k .. length."""

    length: int
    warp: tuple[int, float, int] | None = None

    @property
    def held(self) -> bool:
        return self.length <= 0

    def at(self, step: int):
        """The schedule's step at visit step ``step``: the step itself unless re-planned (an
        int, so an unchanged run computes exactly what it always did)."""
        if self.warp is None or step < self.warp[0]:
            return step
        k, v, end = self.warp
        return v + (step - k) * (self.length - v) / (end - k)

    def progress(self, step: int, start: int = 0, later: int = 0) -> float:
        """The training progress at visit step ``step``, 0 while held: through the visit
        (``start`` and ``later`` 0), or through the run, where the visit starts at global step
        ``start`` and the visits after it take ``later`` steps."""
        if self.held:
            return 0.0
        return (start + self.at(step)) / (start + self.length + later)

    def replan(self, step: int, end: int, warmup: int) -> Schedule:
        """This schedule re-planned at visit step ``step`` to end at visit step ``end``
        (> step). A held schedule starts: the steps after its warm-up run from the start of
        the schedule, its length the new count."""
        if self.held:
            v = min(step, warmup)
            return Schedule(end, None if v == step else (step, float(v), end))
        v = float(min(self.at(step), self.length))
        if v == step and end == self.length:
            return Schedule(self.length)
        return Schedule(self.length, (step, v, end))

    @property
    def end(self) -> int:
        """The visit step the schedule ends on."""
        return self.warp[2] if self.warp is not None else self.length

    def state(self) -> dict:
        """What a checkpoint records of it (``meta``)."""
        return {"schedule_steps": self.length,
                "schedule_warp": list(self.warp) if self.warp is not None else None}

    @classmethod
    def from_state(cls, meta: dict, default_length: int) -> Schedule:
        """The schedule a checkpoint's ``meta`` recorded (``default_length`` where it recorded
        none: a checkpoint of an earlier version, the resumed run's own length)."""
        length = meta.get("schedule_steps")
        warp = meta.get("schedule_warp")
        return cls(default_length if length is None else int(length),
                   None if not warp else (int(warp[0]), float(warp[1]), int(warp[2])))


def describe_replan(old: Schedule, new: Schedule, step: int, lr_now: float, lr_end: float,
                    why: str) -> str:
    """The one log line of a re-plan at visit step ``step``."""
    left = new.end - step
    if old.held:
        return (f"{why}: the learning-rate schedule runs from here over the {left} steps "
                f"left, from {lr_now:.3g} to {lr_end:.3g}")
    if old.at(step) >= old.length:
        return (f"{why}: the learning-rate schedule had ended ({old.length} steps); its last "
                f"rate {lr_now:.3g} continues for the {left} steps left (for a fresh schedule "
                f"start a new run with model.init_from)")
    return (f"{why}: the learning-rate schedule, planned to end after {old.end} steps, is "
            f"re-planned to end after {new.end}: from {lr_now:.3g} now to {lr_end:.3g} over "
            f"the {left} steps left")
