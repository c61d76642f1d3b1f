"""Accounting of the gradient all-reduce, per rank: waiting for the other ranks told apart
from moving the bytes, and what the step waits for after its backward pass.

What each rank measures, on its own clock (``time.perf_counter`` durations: no clock has to
agree with another node's), in :class:`ReduceTimes` (``GradSync.times``):

  enter     from the end of its backward pass to the start of the reduction (Python between
            them, or a rank delayed there);
  first     blocked in the first blocking call of the reduction: without ``parallel.overlap``
            the first bucket's Allreduce; with it the whole final completion of the buckets
            (the buckets polled during backward may be done already, so the skew lands in
            whichever bucket is not, not necessarily the first);
  inside    blocked in the reduction in all (``first`` included);
  progress  with overlap: in the backward hooks that start the buckets and poll them (MPI moves
            a started all-reduce only inside MPI calls; this time lengthens the backward pass);
  arrive    from the last moment the ranks were in step (leaving the previous loss reduction,
            :meth:`GradSync.synced`) to the start of the reduction: 0 before the first one.

**Why waiting and moving can be told apart from durations alone.** No rank leaves an all-reduce
before the last rank has entered it, and all ranks leave it within about one message time of
each other. So the first blocking call absorbs the whole arrival skew: the rank that arrived
last spends only the transfer in it, every other rank the transfer plus how much earlier it
arrived. After that call the ranks are in step, and the later buckets are transfer. Hence per
rank r::

    wait_r    = first_r - min over ranks q of first_q     waiting for the last rank to arrive
    move_r    = inside_r - wait_r                         moving (and reducing) the bytes
    exposed_r = enter_r + inside_r                        the step waits this long after backward

``wait_r`` is 0 on the rank that arrived last; the error is the spread of the ranks' exits from
one all-reduce (part of one bucket's transfer), never the skew itself. ``arrive`` says why a rank
waited: the ranks left the previous reduction together, so ``max_q arrive_q - arrive_r`` is how
much earlier rank r arrived, whether the late rank was held up in its forward, its backward, its
data or between steps, and it is what ``wait_r`` absorbs.

**Rejected:** a one-element all-reduce (or Ibarrier) just before the data to time the arrival:
as exact, but one more collective and one more synchronisation per step, and under overlap it
cannot go before buckets that backward starts; timestamps of the arrivals gathered every N
steps: they need clocks that agree across nodes (``MPI_WTIME_IS_GLOBAL`` is rarely true) and a
gather of their own.

**Cost.** Each rank's four durations travel in the step's one fused all-reduce of the loss terms
and flags (:mod:`deepfusion.engine.train.step`): 5 float64 per rank more in a message that is
sent anyway, no extra collective and no extra synchronisation (``parallel.allreduce_stats``:
"auto" is on from 2 to 16 ranks, where a step record's per-rank lists stay short).
"""
from __future__ import annotations

from dataclasses import dataclass

FIELDS = ("enter", "first", "inside", "progress", "arrive")
DIGITS = 6            # seconds rounded to microseconds in the record


@dataclass
class ReduceTimes:
    """This rank's durations of one gradient reduction, in seconds (module docstring)."""

    enter: float = 0.0
    first: float = 0.0
    inside: float = 0.0
    progress: float = 0.0
    arrive: float = 0.0

    def row(self) -> list[float]:
        return [getattr(self, k) for k in FIELDS]


def attribute(rows: list[list[float]], *, nbytes: int, overlap: bool) -> dict:
    """The step record's ``allreduce_*`` fields from every rank's :meth:`ReduceTimes.row` (in
    rank order): per-rank lists of seconds, the bytes each rank reduced, whether it overlapped."""
    enter, first, inside, progress, arrive = (list(col) for col in zip(*rows))
    low = min(first)
    wait = [f - low for f in first]
    move = [i - w for i, w in zip(inside, wait)]
    exposed = [e + i for e, i in zip(enter, inside)]

    def r(xs):
        return [round(max(0.0, x), DIGITS) for x in xs]
    return {"allreduce_overlap": bool(overlap), "allreduce_bytes": int(nbytes),
            "allreduce_enter_s": r(enter), "allreduce_wait_s": r(wait),
            "allreduce_move_s": r(move), "allreduce_exposed_s": r(exposed),
            "allreduce_progress_s": r(progress), "allreduce_arrive_s": r(arrive)}


def combine(records: list[dict]) -> dict:
    """The fields of several reductions of one step (L-BFGS evaluates, and reduces, more than
    once per step): seconds and bytes summed per rank; {} if none was accounted."""
    records = [r for r in records if r]
    if not records:
        return {}
    out = dict(records[0])
    for rec in records[1:]:
        out["allreduce_bytes"] += rec["allreduce_bytes"]
        for k, v in rec.items():
            if isinstance(v, list):
                out[k] = [round(a + b, DIGITS) for a, b in zip(out[k], v)]
    return out
