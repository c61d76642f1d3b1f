"""The gradient all-reduce of a modelled step, from a measurement or from the assumed bound:
``deepfusion jobs project --measured RUN_OR_JSON`` (repeatable).

A step's wait for its gradient all-reduce is modelled (:func:`deepfusion.jobs.costs.gradient_wait`)
as ``max(0, t_allreduce - h * t_compute)`` with ``parallel.overlap``, all of it without, where
``h`` is the seconds of all-reduce hidden per second of forward and backward. Assumed, ``h`` is
2/3 (the backward pass, with the network moving the bytes while every core computes: a bound).
Measured, from the per-rank accounting of the step records (``allreduce_*`` fields,
``deepfusion/engine/parallel/commstats.py``) of a run directory's metrics.jsonl, or from the
``overlap`` part of a ``make bench`` JSON (``bench.json``, or ``python -m bench.comm_bench``'s):

    T      = move without overlap (the transfer of the whole gradient, mean over ranks)
    cost   = move + hooks with overlap (what the overlapped step still pays: the exposed
             transfer after backward, and the MPI calls in the backward hooks that lengthen it)
    h      = max(0, T - cost) / compute with overlap              (compute: forward + backward)
    skew   = wait / compute, of the mode projected                (arrival skew, a rank lost)

``h`` needs both modes: a bench JSON times them side by side; run directories give one each
(give two ``--measured``). With one mode only, ``h`` stays the assumed bound and the output says
so. The measured skew is added to every modelled step as a share of its compute: a floor, since
more ranks wait for the slowest of more. Where the whole transfer was hidden (``cost`` under 5%
of ``T``), the measured ``h`` is a lower bound and is said to be one.
"""
from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, dataclass

from deepfusion.jobs.costs import BACKWARD_SHARE, gradient_wait

ALL_HIDDEN = 0.05  # cost under this share of T: the whole transfer was hidden (h a lower bound)
WARM_UP_STEPS = 1  # a run's first steps pay one-off costs (allocations, connections)


@dataclass
class Mode:
    """One measured mode (with or without overlap): per-step seconds, means over ranks."""

    overlap: bool
    wait: float
    move: float
    progress: float
    exposed: float
    compute: float
    bytes: int
    ranks: int
    steps: int
    source: str


@dataclass
class AllreduceModel:
    """How ``jobs project`` models a step's gradient all-reduce; :meth:`wait` and :meth:`skew`."""

    hidden_share: float = BACKWARD_SHARE  # h
    skew_share: float = 0.0               # arrival skew per second of compute
    overlap_from: str = "assumed bound"   # "measured", "measured (a lower bound)" or the bound
    skew_from: str = "not modelled"
    sources: tuple[str, ...] = ()
    note: str = ("the all-reduce hidden behind 2/3 of the compute (the backward pass) with "
                 "--overlap, the network moving the bytes while every core computes: a bound")

    def wait(self, t_allreduce: float, t_compute: float, overlap: bool) -> float:
        """Seconds a step waits for its gradient all-reduce after ``t_compute`` of work."""
        return gradient_wait(t_allreduce, t_compute, overlap, self.hidden_share)

    def skew(self, t_compute: float) -> float:
        """Seconds a step's ranks wait for the last one to arrive (measured share, or none)."""
        return self.skew_share * t_compute

    def describe(self, overlap: bool) -> str:
        """One line for the output: which all-reduce model was used, and from what."""
        skew = f"arrival skew {self.skew_share:.1%} of compute, {self.skew_from}" \
            if self.skew_from != "not modelled" else "arrival skew not modelled"
        if not overlap:
            return f"all-reduce not overlapped: the step waits for all of it; {skew}"
        return (f"all-reduce overlapped: h = {self.hidden_share:.3g} s hidden per s of compute, "
                f"{self.overlap_from} ({self.note}); {skew}")

    def as_dict(self) -> dict:
        return asdict(self)


def median(xs):
    return float(statistics.median(xs))


def mean(xs):
    return sum(xs) / len(xs)


def from_run(path: str) -> list[Mode]:
    """The mode of a run directory's (or a metrics.jsonl's) step records that have the
    all-reduce accounting: medians over its steps after the first."""
    metrics = os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path
    recs = []
    with open(metrics, errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line being written, or damaged: metrics.jsonl is read as it is
            if isinstance(rec, dict) and rec.get("kind") == "step" and "allreduce_wait_s" in rec:
                recs.append(rec)
    if not recs:
        raise ValueError(f"{metrics}: no step record has the all-reduce accounting "
                         f"(allreduce_* fields): measure a run on 2 or more ranks with "
                         f"parallel.allreduce_stats on (the default \"auto\" up to 16 ranks)")
    recs = recs[WARM_UP_STEPS:] if len(recs) > WARM_UP_STEPS else recs
    modes = []
    for overlap in (False, True):
        rs = [r for r in recs if bool(r["allreduce_overlap"]) == overlap]
        if rs:
            modes.append(Mode(
                overlap, *(median([mean(r[f"allreduce_{k}_s"]) for r in rs])
                           for k in ("wait", "move", "progress", "exposed")),
                compute=median([r["time_forward"] + r["time_backward"] for r in rs]),
                bytes=int(rs[0]["allreduce_bytes"]), ranks=len(rs[0]["allreduce_wait_s"]),
                steps=len(rs), source=metrics))
    return modes


def from_bench(path: str, doc: dict) -> list[Mode]:
    """The no-overlap and overlap modes of a bench JSON's overlap part."""
    part = doc.get("comm", doc).get("overlap")
    if not isinstance(part, dict):
        raise ValueError(f"{path}: no 'overlap' part (comm.overlap): give the bench.json of "
                         f"make bench (its comm part) or of python -m bench.comm_bench")
    modes = []
    for key, overlap in (("no_overlap", False), ("overlap", True)):
        rec = part.get(key)
        if not rec:
            continue
        if rec.get("wait_s") is None or rec.get("compute_s") is None:
            raise ValueError(f"{path}: comm.overlap.{key} has no per-rank all-reduce accounting "
                             f"(wait_s, move_s, compute_s): run make bench again with this "
                             f"version")
        modes.append(Mode(overlap, *(mean(rec[f"{k}_s"]) for k in ("wait", "move", "progress",
                                                                    "exposed")),
                          compute=rec["compute_s"], bytes=int(rec["bytes"]),
                          ranks=len(rec["wait_s"]), steps=len(rec.get("step_s_rounds", [])),
                          source=f"{path} ({key})"))
    return modes


def load_modes(path: str) -> list[Mode]:
    """The measured modes of ``path``: a run directory, a metrics.jsonl or a bench JSON."""
    if os.path.isdir(path) or path.endswith(".jsonl"):
        return from_run(path)
    with open(path) as f:
        try:
            doc = json.load(f)
        except ValueError:
            raise ValueError(f"{path} is neither a run directory, a metrics.jsonl nor a bench "
                             f"JSON") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a bench JSON (a JSON object with comm.overlap)")
    return from_bench(path, doc)


def measured_model(paths: list[str], overlap: bool) -> AllreduceModel:
    """The all-reduce model of the measurements at ``paths`` (the assumed one if none)."""
    if not paths:
        return AllreduceModel()
    by_mode: dict[bool, Mode] = {}
    for p in paths:
        if not os.path.exists(p):
            raise ValueError(f"--measured {p}: no such run directory or file")
        for m in load_modes(p):
            by_mode.setdefault(m.overlap, m)   # the first measurement of a mode is used
    off, on = by_mode.get(False), by_mode.get(True)
    used = (on or off) if overlap else (off or on)
    model = AllreduceModel(sources=tuple(paths), skew_share=used.wait / used.compute,
                           skew_from=f"measured ({used.ranks} ranks, "
                                     f"{'with' if used.overlap else 'without'} overlap, "
                                     f"{used.source})")
    if on is not None and off is not None:
        cost = on.move + on.progress
        model.hidden_share = max(0.0, off.move - cost) / on.compute
        whole = cost < ALL_HIDDEN * off.move
        model.overlap_from = "measured (a lower bound: the whole transfer was hidden)" if whole \
            else "measured"
        model.note = (f"without overlap the transfer took {off.move * 1e3:.3g} ms, with it "
                      f"{cost * 1e3:.3g} ms stayed exposed (move {on.move * 1e3:.3g} + hooks "
                      f"{on.progress * 1e3:.3g}) beside {on.compute * 1e3:.3g} ms of compute")
    else:
        missing = "with" if off is not None else "without"
        model.note = (f"assumed: 2/3 of the compute; the measurement has no step {missing} "
                      f"overlap to compare with (give a bench JSON, or a run of each)")
    return model
