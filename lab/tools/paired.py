"""Two trained networks on the same held-out draws, paired draw by draw.

    mpiexec -n 2 deepfusion evaluate RUN_A --samples 64     (writes RUN_A/eval_seedS.json)
    mpiexec -n 2 deepfusion evaluate RUN_B --samples 64
    python -m lab.tools.paired RUN_A/eval_seedS.json RUN_B/eval_seedS.json [--out FILE.json]

Both files are ``deepfusion evaluate`` outputs over the same draws (the same ``--seed`` and
number of samples, checked through their parameters). Two runs' means differ by less than the
spread of the draws, so the comparison that decides between them is per draw: the difference
d_i = e_A,i - e_B,i of the relative L2 errors in points (percent), its mean with the
standard error of that mean (std(d) / sqrt(n)), and on how many draws B is the closer: the line
reads "B better by X +- SE points" (or "worse"). The standard error speaks to these draws
only; a second initialisation of each run is what measures the run-to-run spread.

Prints one summary line; writes JSON (files, both means, the differences) to ``--out`` (default
bench/out/paired.json).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from bench.common import ROOT, command_line, emit_json


def load_eval(path: str) -> dict:
    """An evaluate JSON's per-draw errors and the draws they were made on."""
    with open(path) as f:
        d = json.load(f)
    missing = {"rel_l2", "params", "seed"} - set(d)
    if missing:
        raise ValueError(f"{path} has no {', '.join(sorted(missing))}: give the eval_seed*.json "
                         "that `deepfusion evaluate RUN_DIR` writes")
    return d


def compare(path_a: str, path_b: str) -> dict:
    """Per-draw differences of B against A (A minus B, in points): mean, standard error, wins."""
    a, b = load_eval(path_a), load_eval(path_b)
    ea, eb = np.asarray(a["rel_l2"], float), np.asarray(b["rel_l2"], float)
    pa, pb = np.asarray(a["params"], float), np.asarray(b["params"], float)
    if (a["seed"] != b["seed"] or ea.shape != eb.shape or pa.shape != pb.shape
            or not np.allclose(pa, pb)):
        raise ValueError(f"{path_a} (seed {a['seed']}, {ea.size} draws) and {path_b} (seed "
                         f"{b['seed']}, {eb.size} draws) are not the same draws: evaluate both "
                         "runs with the same --seed and --samples")
    if ea.size < 2:
        raise ValueError("a paired comparison needs at least 2 draws (evaluate with --samples N)")
    d = 100.0 * (ea - eb)
    return {"a": os.path.abspath(path_a), "b": os.path.abspath(path_b),
            "seed": a["seed"], "n": int(ea.size),
            "mean_a": float(ea.mean()), "mean_b": float(eb.mean()),
            "diff_points_mean": float(d.mean()),
            "diff_points_se": float(d.std(ddof=1) / np.sqrt(d.size)),
            "b_closer_draws": int((d > 0).sum()),
            "diff_points": d.tolist()}


def summary(res: dict) -> str:
    word = "better" if res["diff_points_mean"] > 0 else "worse"
    return (f"B {res['mean_b']:.2%} against A {res['mean_a']:.2%} on {res['n']} draws (seed "
            f"{res['seed']}): B {word} by {abs(res['diff_points_mean']):.2f} +- "
            f"{res['diff_points_se']:.2f} points (standard error), closer on "
            f"{res['b_closer_draws']} of {res['n']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.tools.paired", description=__doc__.split("\n")[0])
    ap.add_argument("a", help="evaluate JSON of run A (eval_seedS.json)")
    ap.add_argument("b", help="evaluate JSON of run B, the same draws")
    ap.add_argument("--out", help="JSON path (default bench/out/paired.json)")
    args = ap.parse_args(argv)
    try:
        res = compare(args.a, args.b)
    except (OSError, ValueError, json.JSONDecodeError) as e:
        print(f"paired: {e}", file=sys.stderr)
        return 2
    print(summary(res))
    res["command"] = command_line(ap.prog, argv)
    emit_json(res, args.out or os.path.join(ROOT, "bench", "out", "paired.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
