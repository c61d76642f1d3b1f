"""The threshold that flags an answer, calibrated for each model on its own validation draws
and kept in its checkpoint (``meta["answer_check"]``); and the threshold a prediction uses.

Why per model: an answer's residual (``Problem.answer_residual``) is not its error. How much
residual a model's answers carry per unit of error depends on the shape of its errors (a rough
error reads larger than a smooth one of the same size), so on the model, its training and its
loss, not on the PDE alone: a constant per problem fits the model it was measured on.

The rule (:func:`calibrate`). Each validation draw i gives its answer's residual r_i and its
relative L2 error e_i against the reference solver, hence a ratio k_i = r_i / e_i, the
residual per unit of error. An answer at the error level E (default 5%) whose ratio is k reads
k E; the threshold is

    T = E * k_q,    k_q the q-quantile of the ratios (q = 0.1, the lower order statistic),

so an answer worse than E is flagged unless its ratio is among the lowest tenth of the
validation answers': the check misses at most about a tenth of the bad answers whose errors
are shaped like the validation errors. The quantile is low on purpose: a missed bad answer
is used as if right, a false alarm only asks for a look (the reference solver, ``--refine``).
The price is the false alarms, good answers whose ratio is high: an answer of error e is
flagged when e > E k_q / k, so the spread of the ratios (stored: min, k_q, median, max) says
how sharp the check is for this model; the flags it would raise on the validation draws
themselves are stored too. It assumes the residual grows in proportion to the error from the
validation errors (often ~1%) to E; answers far outside the trained family, whose errors are
smooth and large, read lower ratios than rough small ones, the reason for a low quantile.

Where: ``deepfusion train`` calibrates from its final validation (the draws of
``data.eval_seed``, their errors already measured), which runs before the final checkpoint is
saved, so the record is in that checkpoint's metadata as it is first written; ``deepfusion calibrate RUN`` on fresh draws of any seed. Predictions
(:func:`threshold_for`) take a checkpoint's calibrated threshold, else the family's constant
``residual_threshold`` (a checkpoint written before calibration), else none (only non-finite
answers are flagged), and say which.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

KEY = "answer_check"     # the checkpoint meta's key
ERROR_LEVEL = 0.05       # the relative L2 error above which an answer is bad
QUANTILE = 0.1           # of the residual / error ratios (the text above says why)
LEAST_DRAWS = 4          # fewer usable draws: no calibration (a quantile of nothing)


class CalibrationError(ValueError):
    """The draws cannot calibrate a threshold (too few usable ones); the message says why."""


def calibrate(residuals, errors, *, error: float = ERROR_LEVEL,
              quantile: float = QUANTILE) -> dict:
    """The threshold and its evidence from per-draw ``residuals`` and relative ``errors``.

    Draws with a non-finite residual or error, or an error of 0 (no ratio), are left out
    and counted. CalibrationError with fewer than ``LEAST_DRAWS`` usable draws."""
    r = np.asarray(residuals, dtype=np.float64).reshape(-1)
    e = np.asarray(errors, dtype=np.float64).reshape(-1)
    if r.shape != e.shape:
        raise ValueError(f"calibrate: {r.size} residuals against {e.size} errors")
    if not (0 < error < 1 and 0 < quantile < 1):
        raise ValueError(f"calibrate: need 0 < error < 1 and 0 < quantile < 1, got {error}, "
                         f"{quantile}")
    use = np.isfinite(r) & np.isfinite(e) & (e > 0)
    if use.sum() < LEAST_DRAWS:
        raise CalibrationError(
            f"{int(use.sum())} of {r.size} draws have a finite residual and a non-zero error, "
            f"and a threshold needs at least {LEAST_DRAWS}")
    ratio = np.sort(r[use] / e[use])
    k = float(ratio[int(math.floor(quantile * (ratio.size - 1)))])   # the lower order statistic
    threshold = error * k
    bad, flagged = e > error, ~(r <= threshold)
    return {"threshold": threshold, "error": error, "quantile": quantile,
            "draws": int(r.size), "used": int(use.sum()),
            "ratio": {"min": float(ratio.min()), "quantile": k,
                      "median": float(np.median(ratio)), "max": float(ratio.max())},
            "errors": {"mean": float(np.nanmean(e)), "max": float(np.nanmax(e))},
            "residuals": {"median": float(np.nanmedian(r)), "max": float(np.nanmax(r))},
            "validation": {"bad": int(bad.sum()), "bad_flagged": int((bad & flagged).sum()),
                           "good": int((~bad).sum()),
                           "good_flagged": int((~bad & flagged).sum())}}


def record(cal: dict, *, kind: str, grid, seed: int, step: int, by: str) -> dict:
    """A calibration as the checkpoint keeps it: ``cal`` with the residual's kind (the
    family's own or the loss's: ``diffnet.problems.residual_kind``), the grid and seed of the
    draws, the checkpoint's step and what calibrated it."""
    return {**cal, "residual": str(kind), "grid": [int(g) for g in grid], "seed": int(seed),
            "step": int(step), "by": str(by)}


def summary_line(rec: dict) -> str:
    """One line on a calibration, for the commands' output."""
    v, ratio = rec["validation"], rec["ratio"]
    return (f"answer check calibrated on {rec['used']} draws (seed {rec['seed']}): threshold "
            f"{rec['threshold']:.3g}, the residual of a {rec['error']:.0%} error at the "
            f"{rec['quantile']:.0%} quantile of residual/error (spread {ratio['min']:.3g} .. "
            f"{ratio['max']:.3g}); on these draws it flags {v['bad_flagged']} of {v['bad']} "
            f"bad and {v['good_flagged']} of {v['good']} good answers")


@dataclass(frozen=True)
class Threshold:
    """The threshold a prediction flags with (None: none, only non-finite answers flagged),
    ``source`` ("calibrated", "family" or "none") and ``text`` saying where it came from."""

    value: float | None
    source: str
    text: str

    def flags(self, residuals) -> np.ndarray:
        """(N,) bool: the residual is above the threshold or not finite (as
        ``Problem.check_answers`` flags)."""
        r = np.asarray(residuals, dtype=np.float64)
        return ~np.isfinite(r) if self.value is None else ~(r <= self.value)


def threshold_for(meta: dict, problem) -> Threshold:
    """The threshold for answers of ``problem`` by the checkpoint with metadata ``meta``: its
    calibrated one, if calibrated for this problem's kind of residual; else the family's
    ``residual_threshold``; else none."""
    from diffnet.problems import residual_kind

    kind = residual_kind(problem)
    rec = (meta or {}).get(KEY)
    why = "the checkpoint carries no calibrated threshold"
    if isinstance(rec, dict) and rec.get("residual") == kind and _positive(rec.get("threshold")):
        grid = "x".join(map(str, rec.get("grid") or []))
        here = "x".join(map(str, problem.grid))
        note = "" if grid == here else f"; calibrated on {grid}, answers on {here}"
        return Threshold(float(rec["threshold"]), "calibrated",
                         f"calibrated for this model on {rec.get('used')} draws "
                         f"({rec.get('by')}, step {rec.get('step')}): the residual of a "
                         f"{float(rec.get('error', ERROR_LEVEL)):.0%} error{note}")
    if isinstance(rec, dict):
        why = (f"the checkpoint's threshold was calibrated for the {rec.get('residual')!r} "
               f"residual, not this problem's {kind!r}")
    fix = "'deepfusion calibrate RUN' calibrates one"
    family = getattr(problem, "residual_threshold", None)
    if _positive(family):
        return Threshold(float(family), "family",
                         f"the constant threshold of problem {problem.name!r} ({why}; {fix})")
    return Threshold(None, "none", f"no threshold: {why} and problem {problem.name!r} sets "
                                   f"none, so only non-finite answers are flagged; {fix}")


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value) and value > 0


def write(path, rec: dict) -> None:
    """Store the calibration ``rec`` in the checkpoint ``path``'s metadata: the file read
    (verified), its meta updated and written back whole, atomically and sealed, as every
    checkpoint is written (weights, optimiser and RNG states bit for bit)."""
    from deepfusion.engine.checkpoint.store import load_checkpoint, save_checkpoint

    path = os.fspath(path)
    state = load_checkpoint(path)
    state["meta"][KEY] = rec
    save_checkpoint(path, model_state=state["model_state"], optim_state=state["optim_state"],
                    rng_state=state["rng_state"], meta=state["meta"])
