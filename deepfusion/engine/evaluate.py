"""Held-out evaluation: predictions against the task's reference solver.

Held-out parameters are drawn with ``data.eval_seed`` (never the training seed), so they are not
in the training pool. The samples are divided over ranks (the reference solves dominate) and
gathered on rank 0, which writes ``eval.json`` and ``eval.png``.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np
import torch

from diffnet.metrics import max_error, relative_l2


@torch.no_grad()
def predict(model, task, params: np.ndarray, *, dtype=torch.float32, batch: int = 8,
            channels_last: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(inputs (n, C, H, W), predictions (n, H, W)) for parameter vectors (n, k), in batches."""
    model.eval()
    xs, us = [], []
    for lo in range(0, len(params), batch):
        x = task.build_input(params[lo:lo + batch], dtype=dtype)
        xin = x.contiguous(memory_format=torch.channels_last) if channels_last else x
        u = task.impose(model(xin), xin)
        xs.append(x.float().numpy())
        us.append(u[:, 0].float().contiguous().numpy())
    model.train()
    if not xs:  # this rank got no samples (more ranks than held-out draws)
        return np.zeros((0,)), np.zeros((0,))
    return np.concatenate(xs), np.concatenate(us)


def evaluate(model, task, comm, *, n: int, seed: int, dtype=torch.float32,
             channels_last: bool = True) -> dict | None:
    """Relative L2 / max errors on ``n`` held-out draws; the summary on rank 0, None elsewhere."""
    idx = np.arange(n)[comm.rank::comm.size]
    params = task.sample_params(seed, idx)
    t0 = time.perf_counter()
    inputs, preds = predict(model, task, params, dtype=dtype, channels_last=channels_last)
    t_inf = time.perf_counter() - t0
    t0 = time.perf_counter()
    refs = np.stack([task.reference_solution(p) for p in params]) if len(params) else preds
    t_ref = time.perf_counter() - t0
    local = {"idx": idx.tolist(), "params": params.tolist(),
             "rel_l2": np.atleast_1d(relative_l2(preds, refs)).tolist() if len(idx) else [],
             "max_err": np.atleast_1d(max_error(preds, refs)).tolist() if len(idx) else [],
             "t_inf": t_inf, "t_ref": t_ref,
             "examples": _examples(idx, inputs, preds, refs)}
    parts = comm.gather_obj(local)
    if parts is None:  # not rank 0
        return None
    rel = np.array(sum((p["rel_l2"] for p in parts), []))
    mx = np.array(sum((p["max_err"] for p in parts), []))
    order = np.argsort(sum((p["idx"] for p in parts), []))
    rel, mx = rel[order], mx[order]
    params_all = np.array(sum((p["params"] for p in parts), []))[order]
    return {"n": int(n), "seed": int(seed), "rel_l2_mean": float(rel.mean()),
            "rel_l2_median": float(np.median(rel)), "rel_l2_max": float(rel.max()),
            "worst_index": int(rel.argmax()), "max_err_mean": float(mx.mean()),
            "rel_l2": rel.tolist(), "params": params_all.tolist(),
            "seconds_per_sample_inference": sum(p["t_inf"] for p in parts) / n,
            "seconds_per_sample_reference": sum(p["t_ref"] for p in parts) / n,
            "_examples": [e for p in parts for e in p["examples"]]}


def summary_text(summary: dict) -> str:
    """'mean M median D worst W' of a summary's relative L2 (the one wording every report uses)."""
    return (f"mean {summary['rel_l2_mean']:.4f} median {summary['rel_l2_median']:.4f} "
            f"worst {summary['rel_l2_max']:.4f}")


def _examples(idx, inputs, preds, refs, keep: int = 2):
    """A few (input, prediction, reference) triples for the figure (the first ones and worst)."""
    if not len(idx):
        return []
    rel = np.atleast_1d(relative_l2(preds, refs))
    pick = sorted(set(list(range(min(keep, len(idx)))) + [int(rel.argmax())]))
    return [{"i": int(idx[j]), "rel_l2": float(rel[j]), "input": inputs[j, 0].tolist(),
             "pred": preds[j].tolist(), "ref": refs[j].tolist()} for j in pick]


def write_report(summary: dict, run_dir: str, axes=("row", "col"), extent=None):
    """eval.json and eval.png (input, prediction, reference, error) for up to 4 samples.

    ``extent`` = (col_lo, col_hi, row_lo, row_hi) puts physical coordinates on the axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ex = sorted(summary.pop("_examples"), key=lambda e: e["i"])
    worst = max(ex, key=lambda e: e["rel_l2"])
    show = ex[:3] + ([worst] if worst not in ex[:3] else [])
    with open(os.path.join(run_dir, "eval.json"), "w") as f:
        json.dump(summary, f, indent=1)
    fig, axs = plt.subplots(len(show), 4, figsize=(13, 3 * len(show)), squeeze=False)
    for row, e in zip(axs, show):
        pred, ref = np.array(e["pred"]), np.array(e["ref"])
        for ax, img, title in zip(row, (np.array(e["input"]), pred, ref, pred - ref),
                                  ("input", "prediction", "reference", "error")):
            im = ax.imshow(img, origin="lower", aspect="auto", extent=extent, cmap="RdBu_r" if title == "error" else "viridis")
            ax.set_title(f"{title} (held-out #{e['i']}, rel L2 {e['rel_l2']:.3f})" if title == "error" else title,
                         fontsize=8)
            ax.set_xlabel(axes[1])
            ax.set_ylabel(axes[0])
            fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(os.path.join(run_dir, "eval.png"), dpi=90)
    plt.close(fig)
