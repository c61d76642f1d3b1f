"""The threshold that flags an answer, calibrated for each model on its own validation draws
and kept in its checkpoint (``meta["answer_check"]``); and the threshold a prediction uses.

Why per model: an answer's residual (``Problem.answer_residual``) is not its error. How much
residual a model's answers carry per unit of error depends on the shape of its errors (a rough
error reads larger than a smooth one of the same size), so on the model, its training and its
loss, not on the PDE alone: a constant per problem fits the model it was measured on.

The rule (:func:`calibrate`). Each validation draw i gives its answer's residual r_i and its
relative L2 error e_i against the reference solver. The threshold is the residual an answer
of error E (default 5%) reads, read off the draws' own residual-vs-error relation

    log r = log k + b log e,        T = k_q E^b,

b the slope of that relation and k_q the q-quantile (q = 0.1, the lower order statistic) of
the draws' levels k_i = r_i / e_i^b, so that an answer worse than E is flagged unless its
level is among the lowest tenth of the validation answers': the check misses about a tenth of
the bad answers at most, as far as they follow the validation draws' relation. The quantile
is low on purpose: a missed bad answer is used as if right, a false alarm only asks for a look
(the reference solver, ``--refine``).

The slope. With b = 1 (the residual in proportion to the error, as a linear operator's is for
errors of one shape) the rule is the quantile of the ratios r_i / e_i. That extrapolates badly
when the residual has a floor (the residual an answer carries whatever its error: the
discretisation's, a boundary's, a smooth error the residual barely sees): ratios measured on
large errors are small, and scaled down to E they land below every good answer's residual, so
a model whose validation answers are mostly bad flags everything. And when the residual does
not follow the error at all, ratios measured on small errors are large and nothing is flagged.
So b is fitted: least squares of log r on log e, pulled towards 1 by a prior of width
``SLOPE_PRIOR`` as far as the errors' spread fails to determine it (b = (Sxy + l) / (Sxx + l),
l = s^2 / SLOPE_PRIOR^2, s the scatter of the fit; the posterior mean of a slope with prior
N(1, SLOPE_PRIOR^2)), then kept in [0, 1]. Hence the fallback when the validation set has too
few good or too few bad answers: labels do not enter the fit, only the spread of the errors
does; draws whose errors all lie near one value (all good at ~1%, or all bad at ~20%) give a
slope near 1, the ratio rule. A slope above 1 (errors rougher as they grow) is not
extrapolated: from validation errors below E it would raise the threshold on the strength of
an unchecked trend. A slope near 0 says the residual does not follow the error on this model:
the threshold then flags about 1 - q of all answers, good or bad, and the record and the line
printed say so, as when it flags every good validation answer (``separation``: the share of
(bad, good) validation pairs whose bad answer reads the larger residual, 0.5 = blind). The
slope, the spread of the levels (min, k_q, median, max) and the flags the threshold would
raise on the validation draws are stored.

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
QUANTILE = 0.1           # of the levels r / e^b (the text above says why)
LEAST_DRAWS = 4          # fewer usable draws: no calibration (a quantile of nothing)
FEW_DRAWS = 16           # fewer: the 10% quantile is the smallest level or two, the line says so
SLOPE_PRIOR = 0.25       # the width of the slope's prior around 1 (the text above)
BLIND_SLOPE = 0.25       # below: the residual barely follows the error, the line says so
BLIND_SEPARATION = 0.6   # below: it barely orders bad answers above good ones, the same


class CalibrationError(ValueError):
    """The draws cannot calibrate a threshold (too few usable ones); the message says why."""


def calibrate(residuals, errors, *, error: float = ERROR_LEVEL, quantile: float = QUANTILE,
              slope: float | None = None) -> dict:
    """The threshold and its evidence from per-draw ``residuals`` and relative ``errors``;
    ``slope`` fixes b instead of fitting it (1: the ratio rule).

    Draws with a non-finite residual or error, or a residual or error of 0 (no logarithm),
    are left out and counted. CalibrationError with fewer than ``LEAST_DRAWS`` usable draws."""
    r = np.asarray(residuals, dtype=np.float64).reshape(-1)
    e = np.asarray(errors, dtype=np.float64).reshape(-1)
    if r.shape != e.shape:
        raise ValueError(f"calibrate: {r.size} residuals against {e.size} errors")
    if not (0 < error < 1 and 0 < quantile < 1):
        raise ValueError(f"calibrate: need 0 < error < 1 and 0 < quantile < 1, got {error}, "
                         f"{quantile}")
    if slope is not None and not (isinstance(slope, (int, float)) and 0 <= slope <= 1):
        raise ValueError(f"calibrate: a fixed slope must lie in [0, 1], got {slope!r}")
    use = np.isfinite(r) & np.isfinite(e) & (e > 0) & (r > 0)
    if use.sum() < LEAST_DRAWS:
        raise CalibrationError(
            f"{int(use.sum())} of {r.size} draws have a finite non-zero residual and error, "
            f"and a threshold needs at least {LEAST_DRAWS}")
    x, y = np.log(e[use]), np.log(r[use])
    fit = fit_slope(x, y)
    b = fit["slope"] if slope is None else float(slope)
    level = np.sort(np.exp(y - b * x))
    k = float(level[int(math.floor(quantile * (level.size - 1)))])   # lower order statistic
    threshold = k * error ** b
    bad, flagged = e > error, ~(r <= threshold)
    return {"threshold": threshold, "error": error, "quantile": quantile,
            "draws": int(r.size), "used": int(use.sum()),
            "slope": {"used": b, "fitted": fit["fitted"], "scatter": fit["scatter"],
                      "prior": SLOPE_PRIOR, "fixed": slope is not None},
            "level": {"min": float(level.min()), "quantile": k,
                      "median": float(np.median(level)), "max": float(level.max())},
            "errors": {"mean": float(np.nanmean(e)), "max": float(np.nanmax(e))},
            "residuals": {"median": float(np.nanmedian(r)), "max": float(np.nanmax(r))},
            "separation": separation(r[use], bad[use]),
            "validation": {"bad": int(bad.sum()), "bad_flagged": int((bad & flagged).sum()),
                           "good": int((~bad).sum()),
                           "good_flagged": int((~bad & flagged).sum())}}


def fit_slope(x: np.ndarray, y: np.ndarray) -> dict:
    """The slope b of y = log r against x = log e: least squares (``fitted``, None when the
    errors are all equal), pulled towards 1 by the prior N(1, SLOPE_PRIOR^2) with the fit's
    own scatter (``scatter``, of y about the line), then kept in [0, 1] (``slope``)."""
    xc, yc = x - x.mean(), y - y.mean()
    sxx, sxy = float(xc @ xc), float(xc @ yc)
    fitted = sxy / sxx if sxx > 0 else None
    dof = max(x.size - 2, 1)
    scatter = math.sqrt(float(((yc - (fitted or 0.0) * xc) ** 2).sum()) / dof)
    pull = (scatter / SLOPE_PRIOR) ** 2
    b = (sxy + pull) / (sxx + pull) if sxx + pull > 0 else 1.0
    return {"slope": float(min(max(b, 0.0), 1.0)), "fitted": fitted, "scatter": scatter}


def separation(residuals: np.ndarray, bad: np.ndarray) -> float | None:
    """The share of (bad, good) pairs whose bad answer reads the larger residual (ties count
    half): 1 = the residual orders them perfectly, 0.5 = blind; None without both kinds."""
    rb, rg = residuals[bad], residuals[~bad]
    if not (rb.size and rg.size):
        return None
    diff = rb[:, None] - rg[None, :]
    return float(((diff > 0).sum() + 0.5 * (diff == 0).sum()) / diff.size)


def record(cal: dict, *, kind: str, grid, seed: int, step: int, by: str) -> dict:
    """A calibration as the checkpoint keeps it: ``cal`` with the residual's kind (the
    family's own or the loss's: ``diffnet.problems.residual_kind``), the grid and seed of the
    draws, the checkpoint's step and what calibrated it."""
    return {**cal, "residual": str(kind), "grid": [int(g) for g in grid], "seed": int(seed),
            "step": int(step), "by": str(by)}


def summary_line(rec: dict) -> str:
    """One line on a calibration, for the commands' output."""
    v, b, level = rec["validation"], rec["slope"]["used"], rec["level"]
    how = "fixed" if rec["slope"].get("fixed") else "fitted on the draws"
    line = (f"answer check calibrated on {rec['used']} draws (seed {rec['seed']}): threshold "
            f"{rec['threshold']:.3g}, the residual of a {rec['error']:.0%} error (residual ~ "
            f"error^{b:.2f}, {how}; the {rec['quantile']:.0%} quantile of the levels "
            f"residual/error^{b:.2f}, spread {level['min']:.3g} .. {level['max']:.3g}); on "
            f"these draws it flags {v['bad_flagged']} of {v['bad']} bad and "
            f"{v['good_flagged']} of {v['good']} good answers")
    sep = rec.get("separation")
    every_good = v["good"] > 0 and v["good_flagged"] == v["good"]
    if b < BLIND_SLOPE or (sep is not None and sep < BLIND_SEPARATION) or every_good:
        line += ("; the residual barely follows the error for this model"
                 + (f" (a bad answer reads the larger residual in {sep:.0%} of pairs)"
                    if sep is not None else "")
                 + ": its flags say little about which answers are bad")
    if rec["used"] < FEW_DRAWS:
        line += (f"; {rec['used']} draws are few for a quantile: 'deepfusion calibrate RUN "
                 f"--samples 32' calibrates on more")
    return line


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
