"""``train.time_budget``: the step count that ends the training within a wall-time budget,
decided from the run's own step time, then checked three times against the wall time.

The run times its steps in this process: the first ``SKIP`` are not counted (the first step
fills the allocator's pools, the input cache and the network's lazy state; the second can
still pay for some of it), the next ``MEASURE`` are, as the wall time between the ends of two
steps (so logging and the checks between steps count), and their median is the step time
(a median: an evaluation or a checkpoint among them does not swing it). Each rank measures its
own; rank 0 takes the slowest rank's, computes the count from the time left on its clock and
broadcasts the decision, so every rank stops at the same step. The count fills the time left
less a reserve (``RESERVE`` of it) for what the loop does besides steps: the validations, the
checkpoints, the final one. ``train.max_steps``, if set, caps it.

The first steps are slower than the rest (caches, the allocator, and on some hosts the clock
ramping up: a 15-minute budget once ended after 11.7 minutes, its first steps at 0.124 s and
the rest at 0.10 s), the reserve is a guess at the validations' and checkpoints' share, and a
host's speed can change under a run (a neighbour on a shared node). So the count is checked
``CHECKS`` times, at a quarter, half and three quarters of the way from the first decision to
its end: each decided again from the wall time per step since the decision before
(validations and checkpoints included, so only ``CHECK_RESERVE`` is kept, for the final
validation and checkpoint), rank 0's clock against the slowest rank's, broadcast; the last
one is ``final``. A process resumed between two decisions times its steps from its own
``SKIP``-th on; if fewer than ``MEASURE`` of them reach the check, the recorded step time stands
in, so the check is at the same step either way.

Each decision is logged, recorded in ``metrics.jsonl`` (``{"kind": "time_budget"}``) and
in every checkpoint, so a resume continues the same count; a resume under another budget or
another ``train.max_steps`` decides again from the recorded step time and the run's time at
the checkpoint. Until the count is decided the learning-rate schedule is held at its start
(:mod:`.schedule`).

Pure Python (the communicator is passed in): no torch.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, fields

SKIP = 2        # steps of this process not timed: warm-up of the allocator, caches, lazy state
MEASURE = 8     # steps timed after them
RESERVE = 0.1   # share of the time left kept for validations and checkpoints
CHECKS = 3      # decided again at 1/4, 1/2 and 3/4 of the way from the first decision
CHECK_RESERVE = 0.03  # kept then: the wall time per step counts the validations already
UNDECIDED = 2 ** 40  # a budget run's step count until decided (the loop's bound, never reached)


@dataclass(frozen=True)
class Decision:
    """A decided step count and what it was decided from."""

    budget_s: float     # train.time_budget, seconds
    max_steps: int      # train.max_steps then (0: none), the cap
    step_s: float       # the measured step time (the slowest rank's median)
    at_step: int        # the step after which it was decided
    elapsed_s: float    # the run's training time then (resumed segments included)
    steps: int          # the run's step count
    check: int = 0      # 0: the first decision; k: its k-th check, from the wall time per step

    @property
    def final(self) -> bool:
        return self.check >= CHECKS

    def check_step(self) -> int | None:
        """The step the count is decided again at (None: final): a quarter of the way from the
        first decision, then a third and a half of the way left."""
        if self.final:
            return None
        share = (self.steps - self.at_step) // (CHECKS + 1 - self.check)
        return self.at_step + max(MEASURE, share)

    def record(self) -> dict:
        return {**asdict(self), "final": self.final}

    @classmethod
    def from_record(cls, rec: dict | None) -> Decision | None:
        if not rec:
            return None
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in rec.items() if k in names})

    def text(self) -> str:
        left = max(0.0, self.budget_s - self.elapsed_s)
        cap = f", capped by train.max_steps = {self.max_steps}" if self.steps == self.max_steps \
            else ""
        what = (f"of wall time since the decision before (check {self.check} of {CHECKS}; the "
                f"slowest rank's, validations and checkpoints included)" if self.check
                else "(measured, the slowest rank's)")
        kept = (f"{CHECK_RESERVE:.0%} reserve for the final validation and checkpoint"
                if self.check else f"{RESERVE:.0%} reserve for validations and checkpoints")
        return (f"time budget {self.budget_s:g} s: {self.step_s:.3g} s per step {what}, "
                f"{left:.0f} s left at step {self.at_step} less a {kept} -> {self.steps} steps"
                f"{cap}")


def decide(budget_s: float, max_steps: int, step_s: float, at_step: int,
           elapsed_s: float, check: int = 0) -> Decision:
    """The step count that fits ``budget_s`` at ``step_s`` per step, decided after
    ``at_step`` steps and ``elapsed_s`` seconds: never fewer than ``at_step`` (a spent budget
    ends the run where it is), at most ``max_steps`` if that is set; ``check`` k > 0: the k-th
    check, from the wall time per step, keeping the smaller reserve."""
    left = max(0.0, budget_s - elapsed_s) * (1.0 - (CHECK_RESERVE if check else RESERVE))
    steps = at_step + (int(left // step_s) if step_s > 0 else 0)
    if max_steps > 0:
        steps = min(steps, max(max_steps, at_step))
    return Decision(float(budget_s), int(max_steps), float(step_s), int(at_step),
                    float(elapsed_s), int(steps), int(check))


class TimeBudget:
    """The measuring side: step ends in this process, and the collective decision."""

    def __init__(self, seconds: float, max_steps: int, clock=time.perf_counter):
        self.seconds, self.max_steps = float(seconds), int(max_steps)
        self.clock = clock  # (a test's hook may put its own clock here, and t0 from it)
        self.t0 = clock()
        self.ends: list[float] = []
        self.decision: Decision | None = None
        self.mark: tuple | None = None   # (step, clock) the wall-time window starts at

    def tick(self, step: int) -> str | None:
        """Global step ``step`` ended: "decide" or "check" when the count is due to be
        decided, first or again, else None (on every rank alike: every rank takes the same
        steps)."""
        now = self.clock()
        if self.decision is None:
            self.ends.append(now)
            return "decide" if len(self.ends) == SKIP + MEASURE else None
        if self.mark is None:       # resumed after the first decision: past the warm-up
            self.ends.append(now)
            if len(self.ends) == SKIP:
                self.mark = (step, now)
        return "check" if step == self.decision.check_step() else None

    def step_seconds(self) -> float:
        """The median wall time of the timed steps."""
        ends = self.ends[SKIP - 1:]
        return statistics.median(b - a for a, b in zip(ends, ends[1:]))

    def decide(self, comm, step: int, elapsed_before: float) -> Decision:
        """The decision after global step ``step`` (collective): the slowest rank's step
        time, rank 0's clock, rank 0's arithmetic, broadcast."""
        return self.settle(comm, step, elapsed_before, self.step_seconds(), 0)

    def check(self, comm, step: int, elapsed_before: float) -> Decision:
        """The next check's decision at ``step`` (collective), from the wall time per step
        since ``mark`` (the recorded step time if fewer than ``MEASURE`` steps were timed)."""
        mark_step, mark_t = self.mark if self.mark is not None else (step, 0.0)
        window = (self.clock() - mark_t) / (step - mark_step) if step - mark_step >= MEASURE \
            else self.decision.step_s
        return self.settle(comm, step, elapsed_before, window, self.decision.check + 1)

    def settle(self, comm, step: int, elapsed_before: float, step_s: float,
               check: int) -> Decision:
        """The decision at ``step`` from this rank's ``step_s`` (collective): the slowest
        rank's, rank 0's clock and arithmetic, broadcast; the next check times from here."""
        times = comm.gather_obj(step_s)
        d = None
        if times is not None:  # rank 0
            elapsed = elapsed_before + self.clock() - self.t0
            d = decide(self.seconds, self.max_steps, max(times), step, elapsed, check=check)
        self.decision = comm.bcast_obj(d)
        self.mark = (step, self.clock())
        return self.decision

    def resumed(self, recorded: Decision | None, step: int, elapsed_s: float) -> tuple:
        """(decision, why it changed or "") for a run resumed at ``step`` whose checkpoint
        recorded ``recorded`` (None: not decided yet, then it is decided in this process).
        The same budget and cap keep the recorded count; another decides again from the
        recorded step time and the run's time at the checkpoint."""
        if recorded is None:
            return None, ""
        if (recorded.budget_s, recorded.max_steps) == (self.seconds, self.max_steps):
            self.decision = recorded
            return recorded, ""
        self.decision = decide(self.seconds, self.max_steps, recorded.step_s, step, elapsed_s)
        what = (f"train.time_budget {recorded.budget_s:g} s -> {self.seconds:g} s"
                if recorded.budget_s != self.seconds else
                f"train.max_steps {recorded.max_steps} -> {self.max_steps}")
        return self.decision, f"{what}: decided again from the recorded step time"
