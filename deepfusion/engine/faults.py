"""Test-only fault injection, kept out of the user-facing configuration.

``DEEPFUSION_FAULT`` holds comma-separated faults ``KIND@STEP[:RANK]`` (RANK defaults to 0),
each fired at most once per process when the loop is about to take global step STEP
(0-based, the step counter before the step):

* ``raise@13:1``  rank 1 raises :class:`InjectedFailure` (an exception on one rank only);
* ``nan@5``       rank 0's loss of that step is made non-finite (a transient NaN).

Unset (the normal case) costs one dictionary lookup at start-up and nothing per step.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from .errors import InjectedFailure

ENV = "DEEPFUSION_FAULT"
KINDS = ("raise", "nan")


@dataclass
class Faults:
    """The faults of this process, parsed from ``DEEPFUSION_FAULT``."""

    rank: int
    planned: list[tuple[str, int, int]] = field(default_factory=list)

    @classmethod
    def from_env(cls, rank: int) -> "Faults":
        out = cls(rank)
        for item in filter(None, (s.strip() for s in os.environ.get(ENV, "").split(","))):
            kind, _, where = item.partition("@")
            step, _, on = where.partition(":")
            if kind not in KINDS or not step.isdigit() or (on and not on.isdigit()):
                raise ValueError(f"{ENV}: cannot read {item!r}; use KIND@STEP[:RANK] with KIND "
                                 f"one of {', '.join(KINDS)}, e.g. raise@13:1")
            out.planned.append((kind, int(step), int(on or 0)))
        return out

    def fire(self, step: int) -> bool:
        """Raise a planned ``raise`` fault for ``step`` on this rank; True if a ``nan`` fault is
        due (the caller poisons the loss). Each fault fires once."""
        poison = False
        for fault in list(self.planned):
            kind, at, on = fault
            if at != step or on != self.rank:
                continue
            self.planned.remove(fault)
            if kind == "raise":
                raise InjectedFailure(f"injected failure at step {step} on rank {self.rank} "
                                      f"({ENV})")
            poison = True
        return poison
