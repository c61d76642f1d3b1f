"""Where a prediction's error lies: near the reference's fronts (shocks) or away from them.

    python -m lab.tools.error_split PREDS.h5 REF.h5 [--jump 0.05] [--width 3]
                                [--out bench/out/error_split.json]

PREDS.h5 from ``deepfusion infer``, REF.h5 from ``deepfusion solve`` (same draws). A node is
"near a front" when it is within ``--width`` nodes (any direction) of a node where the reference
jumps by more than ``--jump`` to its neighbour along the last axis (x). Per sample: the relative
L2 of the whole field, of the error restricted to the nodes near fronts and to the rest (both
divided by the whole reference's norm, so the two squares add up to the total's), and the
fraction of nodes near fronts.

Wrong side: of the two nodes on either side of each such jump, those the prediction puts nearer
the other side's state than their own (a front one node off there), as a fraction of those
nodes; their share of the squared error; and the relative L2 with them exact. On Burgers this
says how much of the error is shock positions to within a node.
"""
from __future__ import annotations

import argparse
import sys

import h5py
import numpy as np
from scipy.ndimage import binary_dilation

from bench.common import emit_json


def split(pred: np.ndarray, ref: np.ndarray, jump: float, width: int) -> dict:
    err, norm = pred - ref, np.linalg.norm(ref)
    step = np.abs(np.diff(ref, axis=-1, prepend=ref[..., :1]))
    near = binary_dilation(step > jump, iterations=width)
    return {"total": float(np.linalg.norm(err) / norm),
            "near_fronts": float(np.linalg.norm(err[near]) / norm),
            "away": float(np.linalg.norm(err[~near]) / norm),
            "near_fraction": float(near.mean())}


def wrong_side(pred: np.ndarray, ref: np.ndarray, jump: float) -> dict:
    """The nodes beside a jump of ``ref`` (> ``jump`` along the last axis) that ``pred`` puts
    nearer the state across the jump than their own (``split``'s docstring)."""
    lo = np.nonzero(np.abs(np.diff(ref, axis=-1)) > jump)
    hi = lo[:-1] + (lo[-1] + 1,)
    beside, wrong = np.zeros(ref.shape, bool), np.zeros(ref.shape, bool)
    for own, other in ((lo, hi), (hi, lo)):
        beside[own] = True
        off = np.abs(pred[own] - ref[own]) > np.abs(pred[own] - ref[other])
        wrong[tuple(i[off] for i in own)] = True
    err2 = (pred - ref) ** 2
    return {"wrong_side_fraction": float(wrong.sum() / max(1, beside.sum())),
            "wrong_side_share": float(err2[wrong].sum() / max(err2.sum(), 1e-300)),
            "without_wrong_side": float(np.sqrt(err2[~wrong].sum()) / np.linalg.norm(ref))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("preds")
    p.add_argument("ref")
    p.add_argument("--jump", type=float, default=0.05)
    p.add_argument("--width", type=int, default=3)
    p.add_argument("--out", default="bench/out/error_split.json")
    a = p.parse_args(argv)
    with h5py.File(a.preds, "r") as f, h5py.File(a.ref, "r") as g:
        u, r = f["u"][:], g["u"][:]
    if u.shape != r.shape:
        p.error(f"{a.preds} holds fields {u.shape} but {a.ref} holds {r.shape}: infer and "
                f"solve the same draws on the same grid")
    if u.ndim == r.ndim and u.shape[1:2] == (1,):  # (N, 1, ...) -> (N, ...)
        u, r = u[:, 0], r[:, 0]
    rows = [{**split(u[i], r[i], a.jump, a.width), **wrong_side(u[i], r[i], a.jump)}
            for i in range(u.shape[0])]
    for i, row in enumerate(rows):
        print(f"sample {i}: total {row['total']:.4f}  near fronts {row['near_fronts']:.4f}  "
              f"away {row['away']:.4f}  ({100 * row['near_fraction']:.1f}% of the nodes near); "
              f"wrong side: {100 * row['wrong_side_fraction']:.1f}% of the nodes beside a jump, "
              f"{100 * row['wrong_side_share']:.0f}% of the squared error, total "
              f"{row['without_wrong_side']:.4f} without them")
    emit_json({"preds": a.preds, "ref": a.ref, "jump": a.jump, "width": a.width,
               "samples": rows}, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
