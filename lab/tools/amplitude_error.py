"""How much of a prediction's error is a wrong amplitude, and how smooth the error is.

    python -m lab.tools.amplitude_error PREDS.h5 REF.h5 [--modes 4] [--out FILE.json]

PREDS.h5 from ``deepfusion infer``, REF.h5 from ``deepfusion solve`` (same draws, same grid).
Per sample: the relative L2 error; the best scale c = <p, r> / <p, p> of the prediction p
against the reference r (an oracle: it uses the reference) and the relative L2 error of c p;
the share of the error's squared norm in the lowest ``--modes`` x ``--modes`` Fourier modes.
An error that is mostly amplitude and low modes is what the energy's flattest directions look
like (lab/notes/readme-second-release.md, "Ritz scaling").
"""
from __future__ import annotations

import argparse
import sys

import h5py
import numpy as np

from bench.common import emit_json


def analyse(pred: np.ndarray, ref: np.ndarray, modes: int) -> dict:
    err, norm = pred - ref, np.linalg.norm(ref)
    c = float((pred * ref).sum() / (pred * pred).sum())
    power = np.abs(np.fft.fft2(err)) ** 2
    k = np.r_[0:modes, -modes + 1:0]  # the lowest frequencies, both signs
    return {"rel_l2": float(np.linalg.norm(err) / norm), "best_scale": c,
            "rel_l2_best_scale": float(np.linalg.norm(c * pred - ref) / norm),
            "low_mode_share": float(power[np.ix_(k, k)].sum() / power.sum())}


def summary(values) -> dict:
    v = np.asarray(values)
    return {"mean": float(v.mean()), "median": float(np.median(v)), "min": float(v.min()),
            "max": float(v.max())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("preds")
    ap.add_argument("ref")
    ap.add_argument("--modes", type=int, default=4)
    ap.add_argument("--out", default="bench/out/amplitude_error.json")
    a = ap.parse_args(argv)
    with h5py.File(a.preds, "r") as f, h5py.File(a.ref, "r") as g:
        p, r = f["u"][:], g["u"][:]
    if p.shape != r.shape or p.ndim != 3:
        print(f"amplitude_error: {a.preds} holds {p.shape}, {a.ref} {r.shape}; need the same "
              f"(n, H, W) draws on the same grid", file=sys.stderr)
        return 2
    rows = [analyse(pi, ri, a.modes) for pi, ri in zip(p, r)]
    out = {"n": len(rows), "modes": a.modes, "samples": rows,
           **{k: summary([row[k] for row in rows]) for k in rows[0]}}
    for k in rows[0]:
        s = out[k]
        print(f"{k:>18}: mean {s['mean']:.4f} median {s['median']:.4f} "
              f"min {s['min']:.4f} max {s['max']:.4f}")
    emit_json(out, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
