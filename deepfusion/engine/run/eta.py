"""How long a run has left: the ETA of the step log line and of the ``metrics.jsonl`` step
records, and the one way durations are written (``H:MM:SS``).

The remaining time is summed over the visits of the plan (:mod:`.levels`) still to run:

* the rest of the current visit, and any later visit of a level already run in this process,
  at the *median* wall time of that level's last ``WINDOW`` steps (a median, so an evaluation,
  a checkpoint or a rollback between two steps does not swing it);
* a visit of a level not yet run here, at the current level's median scaled by (grid points x
  global batch), the work of a step: an estimate (a level that prolongs the network also
  runs a larger one; a coarse level's fixed costs weigh more), flagged as such so the log can
  say so (``~``) until that level has been measured.

A step's wall time is the time since the previous step of the same visit was logged, so it
counts everything the loop does between steps; the first step of a visit in this process
(no previous one) counts its own ``time_step``. Pure Python and cheap (a median of at most
``WINDOW`` numbers per step): no torch, no MPI, no effect on training.
"""
from __future__ import annotations

import math
import statistics
import time
from collections import deque

WINDOW = 16  # the recent steps a level's median is taken over


def format_duration(seconds: float | None) -> str:
    """``H:MM:SS`` (hours unbounded; "?" when unknown)."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = int(round(max(0.0, seconds)))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def eta_text(seconds: float | None, scaled: bool) -> str:
    """An ETA as the log line and ``deepfusion status`` show it: ``H:MM:SS``; ``~H:MM:SS`` when
    part of it is an estimate for a level not yet run; ``?`` when unknown."""
    return ("~" if scaled and seconds is not None else "") + format_duration(seconds)


def work(visit) -> int:
    """What one step of ``visit`` computes, up to a constant: grid points x global batch."""
    return math.prod(visit.grid) * visit.global_batch


class StepClock:
    """Recent step times per level, and the ETA of a plan (``visits``) from them."""

    def __init__(self, visits, window: int = WINDOW, now=time.perf_counter):
        self.visits = list(visits)
        self.window, self.now = window, now  # (now: the clock, a test's own)
        self.times: dict[int, deque] = {}  # level -> its recent step wall times
        self.last: tuple[int, float] | None = None  # (visit index, perf_counter) of the last step
        self.current = None  # the visit of the last step

    def tick(self, visit, step_seconds: float) -> None:
        """A step of ``visit`` was taken; ``step_seconds`` (its own time) stands in for the wall
        time since the previous step when there is none of this visit."""
        now = self.now()
        dt = (now - self.last[1] if self.last is not None and self.last[0] == visit.index
              else step_seconds)
        self.times.setdefault(visit.level, deque(maxlen=self.window)).append(dt)
        self.last, self.current = (visit.index, now), visit

    def median(self, level: int) -> float | None:
        t = self.times.get(level)
        return statistics.median(t) if t else None

    def eta(self, step: int) -> tuple[float | None, bool]:
        """(seconds to the end of the plan once ``step`` steps are taken, None before any step
        was timed; whether part of it is scaled from another level's time)."""
        if self.current is None:
            return None, False
        ref = self.median(self.current.level)
        total, scaled = 0.0, False
        for v in self.visits:
            left = v.end - max(v.start, step)
            if left <= 0:
                continue
            t = self.median(v.level)
            if t is None:
                t, scaled = ref * work(v) / work(self.current), True
            total += left * t
        return total, scaled
