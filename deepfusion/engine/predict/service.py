"""The prediction service: checkpoint -> problem and work grid -> pipeline -> ranks -> sink.

Every prediction the product makes goes through it: in-training validation and ``deepfusion
evaluate`` (:mod:`.evaluate`), ``deepfusion infer``, the Python API (``deepfusion.load``),
``deepfusion export`` and the benchmarks. The steps, each in one place:

1. the checkpoint loaded for prediction (:mod:`.loader`: :func:`~.loader.load`): the model, the
   problem on the output grid, the work problem, the metadata and the notes for the user;
2. the pipeline (:func:`pipeline`, :mod:`.pipeline`), the per-batch computation; without ranks
   and from given fields it is one torch module (:func:`answer_module`: what ``export``
   writes and ``Solver.module`` is);
3. the share of the samples each rank computes, a unit being a rank or, under a domain split,
   a group of ranks that computes whole samples block by block. Two shares, each kept where
   it is used, because they batch the samples differently and a batch's composition sets the
   last bits of its answers: :func:`strided_draws` (held-out evaluation: draw j to unit
   j mod units, each unit batches its own draws) and :func:`contiguous_batches` (infer:
   global batches [kB, (k+1)B) in a contiguous run per unit, so every sample goes through
   the network in the same batch for any number of ranks);
4. one loop (:func:`run`): each of a unit's batches through ``compute(lo, hi)`` (a
   :class:`Predictor`, or a reference solver), every result to a sink; over ranks
   (:func:`run_blocks`) one gather a round on rank 0, whose sink writes;
5. the sinks: a :class:`Collector` in memory (evaluate, the Python API); the fields file
   writer of ``infer`` / ``solve`` (the command's), any callable of a :class:`Batch`.
"""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import torch

from deepfusion.engine.predict.pipeline import AnswerOnGrid, Batch, Pipeline, Samples
from deepfusion.engine.predict.refine import refine_batch


def pipeline(model, problem, *, work=None, channels_last: bool = False, domain=None,
             dtype=None, post=None, correction: int = 0) -> Pipeline:
    """The prediction pipeline of ``model`` for ``problem`` (the output grid), the network on
    ``work``'s grid (None: the output grid); see :class:`Pipeline` for the rest."""
    return Pipeline(model, problem, work=work, channels_last=channels_last, domain=domain,
                    dtype=dtype, post=post, correction=correction)


def answer_module(model, problem, work=None) -> AnswerOnGrid:
    """Input fields on ``problem``'s grid -> the answer (N, 1, *grid): the pipeline's per-batch
    computation without ranks, in the default (NCHW) layout, in eval mode."""
    return pipeline(model, problem, work=work).module.eval()


# ---------------------------------------------------------------------------------------------
# shares of the samples
# ---------------------------------------------------------------------------------------------

def unit_of(comm, domain=None) -> tuple[int, int]:
    """(this rank's unit, number of units): its rank of ``comm``, or under a domain split its
    group."""
    return (domain.group, domain.groups) if domain else (comm.rank, comm.size)


def strided_draws(n: int, unit: int, units: int) -> np.ndarray:
    """The indices of ``unit``'s share of ``n`` draws: every ``units``-th draw."""
    return np.arange(n)[unit::units]


def contiguous_batches(n: int, batch: int, unit: int = 0, units: int = 1) -> list[tuple[int, int]]:
    """``unit``'s (lo, hi) batches: global batches of ``batch`` samples, contiguous per unit."""
    nb = -(-n // batch)
    first, last = unit * nb // units, (unit + 1) * nb // units
    return [(k * batch, min(n, (k + 1) * batch)) for k in range(first, last)]


def warmup_pays(n: int, batch: int, units: int) -> bool:
    """Whether an untimed warm-up forward pays: only if some unit runs more than one batch.
    With one batch each (e.g. one huge field) it would double the wall time only to keep
    kernel selection out of the timing, so the timing then includes it."""
    return n > batch * units


# ---------------------------------------------------------------------------------------------
# one batch
# ---------------------------------------------------------------------------------------------

class Predictor:
    """``compute(lo, hi)`` of the loop: samples [lo, hi) through ``pipe`` under ``mode``
    (``torch.inference_mode``; validation passes ``torch.no_grad``: training continues on the
    same objects), a :class:`Batch` with the answer's seconds (the inputs recorded on the
    output grid are built outside the time).

    ``keep_inputs``: the batch keeps its inputs on the output grid (a file records them).
    ``warmup``: every new batch size first runs once untimed (one-off kernel selection stays
    out of the timing). ``finish(batch) -> batch``: applied, inside ``mode``, to a batch whose
    answers this rank holds (e.g. :func:`as_arrays`).
    """

    def __init__(self, pipe: Pipeline, samples: Samples, *, mode=torch.inference_mode,
                 keep_inputs: bool = True, warmup: bool = False, finish=None):
        self.pipe, self.samples, self.mode = pipe, samples, mode
        self.keep_inputs, self.warmup, self.finish = keep_inputs, warmup, finish
        self.warm: set = set()

    def __call__(self, lo: int, hi: int) -> Batch:
        pipe, samples = self.pipe, self.samples
        with self.mode():
            x = pipe.record(samples, lo, hi) if self.keep_inputs else None
            if self.warmup and hi - lo not in self.warm:
                pipe.answer_batch(samples, lo, hi, x)
                self.warm.add(hi - lo)
            t0 = time.perf_counter()
            b = pipe.answer_batch(samples, lo, hi, x)
            b.seconds = time.perf_counter() - t0
            if b.u is None or self.finish is None:
                return b
            return self.finish(b)


def as_arrays(problem, samples: Samples, *, refine=None, check: bool = False,
              threshold: float | None = None):
    """A :class:`Predictor`'s ``finish``: the batch's answers and inputs as float32 arrays, as
    a fields file and evaluation keep them. ``refine`` (a tolerance): each answer refined by
    the problem's reference solver (:mod:`.refine`), float64, with its per-sample records.
    ``check``: each answer's residual and flag (``Problem.check_answers``: above
    ``threshold``, default the family's, :mod:`.calibration`) among its records."""
    def finish(b: Batch) -> Batch:
        if refine is not None:
            u, records = refine_batch(problem, b.u, samples.inputs(problem, b.lo, b.hi,
                                                                   torch.float64), refine)
        else:
            u, records = b.u.float().contiguous().numpy(), {}
        if check:
            records.update(problem.check_answers(u, samples.inputs(problem, b.lo, b.hi,
                                                                   torch.float64), threshold))
        inputs = b.inputs.float().numpy() if b.inputs is not None else None
        return replace(b, u=u, inputs=inputs, extra={**b.extra, **records})
    return finish


# ---------------------------------------------------------------------------------------------
# the loop and its sinks
# ---------------------------------------------------------------------------------------------

def run(compute, batches, sink=None, *, comm=None, rounds: int | None = None) -> float:
    """Each (lo, hi) of ``batches`` through ``compute(lo, hi) -> Batch``, in order, and every
    result to ``sink(batch)``; returns the seconds the results report.

    With ``comm``, one gather a round on its rank 0, whose sink (the others have none) gets
    the round's results that hold answers, in rank order; ``rounds`` (the most batches any
    rank has) makes every rank join every gather, with nothing once its batches are done."""
    busy = 0.0
    for k in range(len(batches) if rounds is None else rounds):
        result = compute(*batches[k]) if k < len(batches) else None
        busy += result.seconds if result is not None else 0.0
        if comm is None:
            results = [result]
        else:   # only results that hold answers travel; rank 0 alone gets the list
            held = result if result is not None and result.u is not None else None
            results = comm.gather_obj(held) or []
        for b in results:
            if b is not None and sink is not None:
                sink(b)
        del result, results
    return busy


def run_blocks(comm, n: int, batch: int, compute, sink=None, domain=None) -> float:
    """:func:`run` over ``comm``'s ranks with the :func:`contiguous_batches` share of ``n``
    samples (under a domain split (``domain``) the units are its groups: every rank of a group
    computes the group's batches together); rank 0's ``sink`` gets every result. Returns the
    compute seconds summed over the ranks (on every rank)."""
    unit, units = unit_of(comm, domain)
    mine = contiguous_batches(n, batch, unit, units)
    rounds = max(len(contiguous_batches(n, batch, u, units)) for u in range(units))
    busy = run(compute, mine, sink, comm=comm, rounds=rounds)
    return float(sum(comm.allgather_obj(busy)))


class Collector:
    """A sink that keeps every result in memory, in order (``batches``)."""

    def __init__(self):
        self.batches: list[Batch] = []

    def __call__(self, b: Batch) -> None:
        self.batches.append(b)

    def held(self) -> list[Batch]:
        """The results whose answers this rank holds."""
        return [b for b in self.batches if b.u is not None]


def predict_here(pipe: Pipeline, samples: Samples, batch: int, **kw) -> Collector:
    """Every sample through ``pipe`` in this process alone, in batches of ``batch`` samples:
    the collected results. ``kw``: the :class:`Predictor`'s options."""
    sink = Collector()
    run(Predictor(pipe, samples, **kw), contiguous_batches(samples.n, batch), sink)
    return sink
