"""Answers refined by the problem's iterative reference solver (``Problem.refine``): the
network's answer is the solver's initial guess, solved on to a relative residual.

``deepfusion infer --refine TOL`` and the Python API (``predict(..., refine=TOL)``) both go
through :func:`refine_batch`; a fields file records the per-sample outcome under the names of
:data:`DATASETS`. The refined answers are float64: rounding a field to float32 adds a residual
far above any tolerance worth asking for (an error of one part in 1e7 at the grid scale is
amplified by the operator's h^-2), so they are stored and returned in double precision.
"""
from __future__ import annotations

import time

import numpy as np

# per-sample outcome of a refinement: name -> (dtype, what it is)
DATASETS = {
    "refine_iterations": ("int64", "iterations of the solver started from the network's answer"),
    "refine_residual": ("float64", "relative residual ||b - A u|| / ||b|| of the written answer"),
    "refine_initial_residual": ("float64", "the same of the network's answer (the guess)"),
    "refine_seconds": ("float64", "seconds of the refinement: assembly, solver setup, solve"),
}


def check_refine(problem, tol, setting: str = "refine"):
    """``tol`` as a float (None: no refinement); ValueError starting with ``setting`` (the
    option that asked, e.g. "--refine") and the problem's own reason when the problem cannot
    refine an answer or ``tol`` is not in (0, 1)."""
    if tol is None:
        return None
    try:
        return problem.check_refine(tol)
    except ValueError as e:
        raise ValueError(f"{setting} {tol}: {e}") from None


def refine_batch(problem, u, x, tol: float) -> tuple[np.ndarray, dict]:
    """Answers ``u`` (b, *grid) to the inputs ``x`` (b, C, *grid) (numpy or torch, on
    ``problem``'s grid), each refined by ``problem.refine`` to the relative residual ``tol``:
    (the refined answers (b, *grid) float64, {name of :data:`DATASETS`: (b,) array})."""
    u, x = _numpy(u), _numpy(x)
    out = np.empty(u.shape, dtype=np.float64)
    rec = {name: np.zeros(len(u), dtype=dtype) for name, (dtype, _) in DATASETS.items()}
    for j in range(len(u)):
        t0 = time.perf_counter()
        out[j], info = problem.refine(x[j], u[j], tol)
        rec["refine_seconds"][j] = time.perf_counter() - t0
        rec["refine_iterations"][j] = info["iterations"]
        rec["refine_residual"][j] = info["residual"]
        rec["refine_initial_residual"][j] = info["initial_residual"]
    return out, rec


def report(records: dict | None, tol) -> dict:
    """What a command says of its refinement: {"attrs": the fields file's root attributes,
    "text": its part of the summary line, "warnings": one per unconverged sample}, from the
    records of every sample (None where they are not held, e.g. on a rank that does not
    write: the attributes only). Empty without refinement (``tol`` None)."""
    if tol is None:
        return {"attrs": {}, "text": "", "warnings": []}
    out = {"attrs": {"refined": True, "refine_tol": float(tol)}, "text": "", "warnings": []}
    if records is None:
        return out
    it, res = records["refine_iterations"], records["refine_residual"]
    out["text"] = (f"; refined to {tol:g} by the reference solver: {np.median(it):g} "
                   f"iterations (median, max {it.max()}), residual <= {res.max():.2g}, "
                   f"{records['refine_seconds'].mean():.3g} s/sample")
    bad = unconverged(records, tol)
    if bad:
        out["warnings"].append(f"{len(bad)} sample(s) stopped above the tolerance {tol:g} "
                               f"(the solver's iteration cap): {bad[:10]}, residuals "
                               f"{[float(f'{r:.3g}') for r in res[bad[:10]]]}")
    return out


def unconverged(rec: dict, tol: float) -> list[int]:
    """The sample indices (within ``rec``) whose refinement stopped above ``tol`` (the
    solver's iteration cap)."""
    return [int(j) for j in np.flatnonzero(~(rec["refine_residual"] <= tol))]


def _numpy(a) -> np.ndarray:
    """A torch tensor or an array as a float64 numpy array."""
    if hasattr(a, "detach"):
        a = a.detach().cpu().double().numpy()
    return np.asarray(a, dtype=np.float64)
