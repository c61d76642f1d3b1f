"""Held-out evaluation: predictions against the problem's reference solver.

Held-out parameters are drawn with ``data.eval_seed`` (never the training seed), so they are not
in the training pool. The draws are divided over ranks (the reference solves dominate), every
rank's strided share predicted through the prediction service (:mod:`.service`), and the
results gathered on rank 0, which writes ``eval.json`` and ``eval.png`` (:mod:`.plots`: 2-D fields
whole, 3-D fields as three orthogonal mid-slices).

A problem without a reference solver (empty ``reference_methods``) has no error to measure:
its evaluation reports the loss of each prediction and its terms (the PDE residual, the
boundary terms) on the same draws instead, and says so (:func:`quantity`); no figure.
"""
from __future__ import annotations

import json
import os
import time
import warnings

import numpy as np
import torch

from diffnet.metrics import max_error, relative_l2
from diffnet.problems import has_reference

from deepfusion.engine.predict import service
from deepfusion.engine.predict.pipeline import Samples
from deepfusion.engine.predict.plots import fields_figure, views


@torch.no_grad()
def predict(model, problem, params: np.ndarray, *, dtype=torch.float32, batch: int = 8,
            channels_last: bool = True, domain=None, terms: bool = False,
            correction: int = 0) -> tuple:
    """(inputs (n, C, *grid), predictions (n, *grid)) for parameter vectors (n, k), in batches
    through the prediction service in this rank (its unit) alone; with ``terms``, a third
    item: each loss term of each prediction ({name: (n,)}). ``correction``: the answers'
    coarse correction (cells per axis, 0: none).

    Under a domain split (``domain``, ``model`` and ``problem`` on its block) the group's first
    rank gets the whole inputs and predictions, the other ranks empty arrays; the terms are the
    whole field's (summed over the blocks: collective within the group) on every rank."""
    def loss_terms(u, x):  # the pipeline's post-step: per sample, summed over the blocks
        return {k: problem.block.sum(v.detach().contiguous()).double().numpy()
                for k, v in problem.loss_terms(u, x).items()}
    pipe = service.pipeline(model, problem, channels_last=channels_last, domain=domain,
                            dtype=dtype, post=loss_terms if terms else None,
                            correction=correction)
    samples = Samples(params)
    model.eval()
    done = service.predict_here(pipe, samples, batch, mode=torch.no_grad,
                                finish=service.as_arrays(problem, samples))
    model.train()
    held = done.held()
    out = (np.concatenate([b.inputs for b in held]), np.concatenate([b.u for b in held])) \
        if held else (np.zeros((0,)), np.zeros((0,)))
    if not terms:
        return out
    ts = [b.extra for b in done.batches]
    return out + ({k: np.concatenate([t[k] for t in ts]) for k in ts[0]} if ts else {},)


def answer_residuals(problem, preds: np.ndarray, params: np.ndarray,
                     batch: int = 8) -> np.ndarray:
    """(n,) each prediction's answer residual (``Problem.answer_residual``, the inputs
    rendered in float64 as ``infer`` checks them), in batches; a residual that fails (a
    user's loss in float64, say) is NaN with a warning naming the failure, so that an
    evaluation never fails for its check (nor leaves another rank waiting)."""
    out = np.full(len(params), np.nan)
    for lo in range(0, len(params), batch):
        hi = min(lo + batch, len(params))
        try:
            x = problem.build_input(params[lo:hi], dtype=torch.float64)
            out[lo:hi] = np.asarray(problem.answer_residual(preds[lo:hi], x), dtype=np.float64)
        except Exception as e:  # noqa: BLE001 -- any failure of a problem's code
            warnings.warn(f"the answer residual of problem {problem.name!r} failed on draws "
                          f"{lo}..{hi - 1} of this rank ({type(e).__name__}: {e}): they are "
                          f"not checked", RuntimeWarning, stacklevel=2)
    return out


def evaluate(model, problem, comm, *, n: int, seed: int, dtype=torch.float32,
             channels_last: bool = True, domain=None, check: bool = False,
             correction: int = 0) -> dict | None:
    """Relative L2 / max errors on ``n`` held-out draws; the summary on rank 0, None elsewhere.
    ``check``: each draw's answer residual too ("residual", in draw order), what calibrates
    the threshold of the answer check (:mod:`.calibration`). ``correction``: the answers'
    coarse correction (cells per axis, 0: none).

    Under a domain split (``domain``: the model's :class:`~deepfusion.engine.parallel.parallelize.Domain`,
    ``problem`` on its block) each group predicts its draws block by block and its first rank
    assembles the fields and compares them with the reference. A problem without a reference
    solver: :func:`evaluate_loss`."""
    if not has_reference(problem):
        return evaluate_loss(model, problem, comm, n=n, seed=seed, dtype=dtype,
                             channels_last=channels_last, domain=domain, correction=correction)
    idx, params = _my_draws(problem, comm, n, seed, domain)
    t0 = time.perf_counter()
    inputs, preds = predict(model, problem, params, dtype=dtype, channels_last=channels_last,
                            domain=domain, correction=correction)
    if domain is not None and domain.comm.rank != 0:  # the group's first rank reports its draws
        idx, params = idx[:0], params[:0]
    t_inf = time.perf_counter() - t0
    t0 = time.perf_counter()
    refs = np.stack([problem.reference_solution(p) for p in params]) if len(params) else preds
    t_ref = time.perf_counter() - t0
    dims = len(problem.grid)
    local = {"idx": idx.tolist(), "params": params.tolist(),
             "rel_l2": relative_l2(preds, refs, dims=dims).tolist() if len(idx) else [],
             "max_err": max_error(preds, refs, dims=dims).tolist() if len(idx) else [],
             "t_inf": t_inf, "t_ref": t_ref,
             "examples": _examples(idx, inputs, preds, refs)}
    if check:   # outside the inference time
        local["residual"] = answer_residuals(problem, preds, params).tolist() if len(idx) else []
    parts = comm.gather_obj(local)
    if parts is None:  # not rank 0
        return None
    order = np.argsort(sum((p["idx"] for p in parts), []))
    rel = _in_draw_order([p["rel_l2"] for p in parts], order)
    mx = _in_draw_order([p["max_err"] for p in parts], order)
    params_all = _in_draw_order([p["params"] for p in parts], order)
    checked = {"residual": _in_draw_order([p["residual"] for p in parts], order).tolist()} \
        if check else {}
    return {**checked, "n": int(n), "seed": int(seed), "rel_l2_mean": float(rel.mean()),
            "rel_l2_median": float(np.median(rel)), "rel_l2_max": float(rel.max()),
            "worst_index": int(rel.argmax()), "max_err_mean": float(mx.mean()),
            "rel_l2": rel.tolist(), "params": params_all.tolist(),
            "seconds_per_sample_inference": sum(p["t_inf"] for p in parts) / n,
            "seconds_per_sample_reference": sum(p["t_ref"] for p in parts) / n,
            "_examples": [e for p in parts for e in p["examples"]]}


def evaluate_loss(model, problem, comm, *, n: int, seed: int, dtype=torch.float32,
                  channels_last: bool = True, domain=None, correction: int = 0) -> dict | None:
    """The loss of each prediction and its terms on ``n`` held-out draws, for a problem with no
    reference solver (no error to measure); the summary on rank 0, None elsewhere."""
    idx, params = _my_draws(problem, comm, n, seed, domain)
    t0 = time.perf_counter()
    _inputs, _preds, terms = predict(model, problem, params, dtype=dtype, terms=True,
                                     channels_last=channels_last, domain=domain,
                                     correction=correction)
    if domain is not None and domain.comm.rank != 0:  # the group's first rank reports
        idx, params, terms = idx[:0], params[:0], {}
    local = {"idx": idx.tolist(), "params": params.tolist(), "t_inf": time.perf_counter() - t0,
             "terms": {k: v.tolist() for k, v in terms.items()}}
    parts = comm.gather_obj(local)
    if parts is None:  # not rank 0
        return None
    order = np.argsort(sum((p["idx"] for p in parts), []))
    names = next(list(p["terms"]) for p in parts if p["terms"])
    terms = {k: _in_draw_order([p["terms"][k] for p in parts if p["terms"]], order)
             for k in names}
    loss = sum(terms.values())
    return {"n": int(n), "seed": int(seed), "reference": False,
            "loss_mean": float(loss.mean()), "loss_median": float(np.median(loss)),
            "loss_max": float(loss.max()), "worst_index": int(loss.argmax()),
            "terms_mean": {k: float(v.mean()) for k, v in terms.items()},
            "loss": loss.tolist(), "terms": {k: v.tolist() for k, v in terms.items()},
            "params": _in_draw_order([p["params"] for p in parts], order).tolist(),
            "seconds_per_sample_inference": sum(p["t_inf"] for p in parts) / n,
            "_examples": []}


def _my_draws(problem, comm, n: int, seed: int, domain=None) -> tuple[np.ndarray, np.ndarray]:
    """(indices, parameter vectors) of this rank's share of ``n`` held-out draws: every
    ``units``-th draw, a unit being a rank or, under a domain split, a group of ranks."""
    idx = service.strided_draws(n, *service.unit_of(comm, domain))
    return idx, problem.sample_params(seed, idx)


def _in_draw_order(lists, order) -> np.ndarray:
    """The ranks' gathered per-draw lists, concatenated and put in draw order."""
    return np.array(sum(lists, []))[order]


def summary_text(summary: dict) -> str:
    """'mean M median D worst W' of a summary's relative L2 (the one wording every report uses);
    of its loss, with each term's mean, for a problem without a reference solver."""
    if summary.get("reference", True):
        return (f"mean {summary['rel_l2_mean']:.4f} median {summary['rel_l2_median']:.4f} "
                f"worst {summary['rel_l2_max']:.4f}")
    terms = ", ".join(f"{k} {v:.4g}" for k, v in summary["terms_mean"].items())
    return (f"mean {summary['loss_mean']:.4g} median {summary['loss_median']:.4g} "
            f"worst {summary['loss_max']:.4g} (term means: {terms})")


def quantity(summary: dict, short: bool = False) -> str:
    """What a summary measures, for the report line: the relative L2 error, or (no reference
    solver) the loss."""
    if summary.get("reference", True):
        return "rel L2" if short else "relative L2"
    return "loss (no reference solver, so no error)"


def eval_record(summary: dict) -> dict:
    """The summary's mean, median and worst, for the run log's eval record."""
    keys = ("rel_l2_mean", "rel_l2_median", "rel_l2_max") if summary.get("reference", True) \
        else ("loss_mean", "loss_median", "loss_max")
    return {k: summary[k] for k in keys}


def _examples(idx, inputs, preds, refs, keep: int = 2):
    """A few (input, prediction, reference) for the figure (the first ones and the worst), each
    kept as its :func:`~deepfusion.engine.predict.plots.views` (a 3-D field: three planes)."""
    if not len(idx):
        return []
    rel = relative_l2(preds, refs, dims=preds.ndim - 1)  # (n, *grid): a batch
    pick = sorted(set(list(range(min(keep, len(idx)))) + [int(rel.argmax())]))
    return [{"i": int(idx[j]), "rel_l2": float(rel[j]), "grid": list(preds.shape[1:]),
             "input": views(inputs[j, 0]), "pred": views(preds[j]), "ref": views(refs[j])}
            for j in pick]


def write_report(summary: dict, run_dir: str, axes, *, plot: bool = True) -> None:
    """eval.json and (``plot``) eval.png (input, prediction, reference, error) for up to 4
    samples.

    ``axes``: the problem's axes (``name``, ``lo``, ``hi`` each), for names and physical
    coordinates; a 3-D problem's samples are shown as three orthogonal mid-slices. Without a
    reference solver: eval.json only."""
    ex = sorted(summary.pop("_examples"), key=lambda e: e["i"])
    with open(os.path.join(run_dir, "eval.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if not plot or not ex:
        return
    worst = max(ex, key=lambda e: e["rel_l2"])
    show = ex[:3] + ([worst] if worst not in ex[:3] else [])
    rows = [{**e, "error_title": f"error (held-out #{e['i']}, rel L2 {e['rel_l2']:.3f})"}
            for e in show]
    fields_figure(os.path.join(run_dir, "eval.png"), rows, names=[a.name for a in axes],
                  bounds=[(a.lo, a.hi) for a in axes], grid=show[0]["grid"])
