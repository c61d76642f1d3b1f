"""Does an answer's residual flag the bad answers? A trained model on held-out draws of its own
family and of families it was not trained on, each answer's error against the reference beside
the signals that could flag it.

    python -m lab.tools.residual_flags RUN \\
        --family trained --family contrast-30/1 a_hi=30 a_lo=1 --family tau-6 tau=6 \\
        [--samples 32] [--seed S] [--calibrate 32] [--bad 0.05] [--threshold R] \\
        [--batch 8] [--out FILE.json]

RUN is a run directory (its newest complete checkpoint) or a checkpoint. Each ``--family NAME
[KEY=VALUE ...]`` is the trained problem with those options replaced (values parsed as JSON,
else kept as text: ``c_range=[6,10]``, ``tau=6``); NAME labels it. Every family answers
``--samples`` draws of ``--seed`` (default: the run's ``data.test_seed``, never trained on nor
tuned on) on the training grid, through ``diffnet.answer.Answer`` (network, boundary
imposition, answer head), and the reference solver answers the same draws.

Per draw: ``error`` (relative L2 to the reference), ``residual`` (``Problem.answer_residual``),
``loss`` (the problem's training loss, the sum of its terms), for the elliptic families
``nodal_residual`` (the residual before its subdomain sums, ``answer_check``),
``fields_out_of_range`` (an input channel leaves the range the trained family's draws span)
and ``params_out_of_range`` (a parameter outside the trained ``param_bounds``, or another
number of parameters). An answer is bad when its error is above ``--bad``. For each family,
and pooled over all: for each signal the share of bad answers flagged and of good answers
flagged (the residual above ``--threshold``, default the problem's ``residual_threshold``;
the loss above the largest loss of the calibration draws), and the best split (Youden's J).

Calibration: ``--calibrate`` draws of the trained family from the run's ``data.eval_seed`` (the
validation draws: not trained on, and apart from the measured ones); the JSON reports their
largest residual and error, from which the problem's threshold is chosen (docs/answer-check.md).

Also the cost of the residual per sample against the forward pass. JSON to ``--out`` (default
stdout); one line per family on stderr.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from bench.common import command_line, emit_json
from diffnet.problems.contract.answer_check import elliptic_residual

SCORES = ("residual", "nodal_residual", "loss")     # per-draw numbers that could flag


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m lab.tools.residual_flags",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("run", help="run directory or checkpoint file")
    ap.add_argument("--family", nargs="+", action="append", required=True,
                    metavar="NAME [KEY=VALUE ...]")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seed", type=int, help="default: the run's data.test_seed")
    ap.add_argument("--calibrate", type=int, default=32,
                    help="trained-family draws of data.eval_seed (0: none)")
    ap.add_argument("--bad", type=float, default=0.05, help="relative L2 above which an "
                                                            "answer is bad")
    ap.add_argument("--threshold", type=float, help="default: the problem's residual_threshold")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.samples < 1 or args.batch < 1 or args.calibrate < 0:
        ap.error("--samples and --batch must be >= 1, --calibrate >= 0")
    args.families = [(f[0], dict(option(kv, ap) for kv in f[1:])) for f in args.family]
    args.command = command_line(ap.prog, argv)
    return args


def option(text: str, ap) -> tuple[str, object]:
    """'KEY=VALUE' -> (KEY, VALUE parsed as JSON, else the text)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        ap.error(f"--family options are KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


class Family:
    """One family's problem and the model, on the training grid."""

    def __init__(self, run: str, options: dict):
        from deepfusion.engine.predict.loader import checkpoint_file, load_model
        from diffnet.answer import Answer

        self.path = checkpoint_file(run)
        model, self.problem, _, self.meta = load_model(self.path, options=options or None)
        self.answer = Answer(model, self.problem).eval()
        self.dtype = next(model.parameters()).dtype

    def answers(self, params: np.ndarray, batch: int):
        """(u (N, 1, *grid) float64, inputs (N, C, *grid) float64, forward seconds)."""
        us, xs, sec = [], [], 0.0
        with torch.inference_mode():
            for lo in range(0, len(params), batch):
                x = self.problem.build_input(params[lo:lo + batch], dtype=self.dtype)
                t0 = time.perf_counter()
                us.append(self.answer(x).double())
                sec += time.perf_counter() - t0
                xs.append(x.double())
        return torch.cat(us), torch.cat(xs), sec


def channel_ranges(trained, params: np.ndarray) -> np.ndarray:
    """(C, 2) min / max of each input channel over the trained family's draws ``params``."""
    x = trained.build_input(params, dtype=torch.float64).numpy()
    axes = (0,) + tuple(range(2, x.ndim))
    return np.stack([x.min(axis=axes), x.max(axis=axes)], axis=1)


def out_of_range(x: torch.Tensor, ranges: np.ndarray) -> np.ndarray:
    """(N,) bool: some channel of the input leaves its trained range (by more than 1e-6 of
    the range's width)."""
    x = x.numpy()
    slack = 1e-6 * np.maximum(ranges[:, 1] - ranges[:, 0], 1e-12)
    shape = (1, -1) + (1,) * (x.ndim - 2)
    lo, hi = (ranges[:, 0] - slack).reshape(shape), (ranges[:, 1] + slack).reshape(shape)
    return ((x < lo) | (x > hi)).reshape(len(x), -1).any(axis=1)


def params_outside(params: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """(N,) bool: a parameter outside the trained bounds (every draw, when the family has
    another number of parameters than the trained one)."""
    if params.shape[1] != len(bounds):
        return np.ones(len(params), dtype=bool)
    return ((params < bounds[:, 0]) | (params > bounds[:, 1])).any(axis=1)


def draws(fam: Family, params: np.ndarray, batch: int, ranges, bounds) -> dict:
    """Per-draw error, residual, loss and range flags of one family's draws, and the timings."""
    p = fam.problem
    u, x, forward_s = fam.answers(params, batch)
    t0 = time.perf_counter()
    residual = p.answer_residual(u, x)
    residual_s = time.perf_counter() - t0
    with torch.no_grad():
        loss = sum(p.loss_terms(u, x).values()).numpy()
    # the elliptic families' nodal residual, before the subdomain sums: reported beside it
    nodal = elliptic_residual(p, u, x, cells=0) if hasattr(p, "system_nu") else None
    t0 = time.perf_counter()
    ref = np.stack([p.reference_solution(q) for q in params])
    reference_s = time.perf_counter() - t0
    got = u[:, 0].numpy()
    error = (np.linalg.norm((got - ref).reshape(len(ref), -1), axis=1)
             / np.linalg.norm(ref.reshape(len(ref), -1), axis=1))
    return {"error": error, "residual": residual, "loss": loss, "nodal_residual": nodal,
            "fields_out_of_range": out_of_range(x, ranges),
            "params_out_of_range": params_outside(params, bounds),
            "seconds_per_sample": {"forward": forward_s / len(params),
                                   "residual": residual_s / len(params),
                                   "reference": reference_s / len(params)}}


def shares(flagged: np.ndarray, bad: np.ndarray) -> dict:
    """Share of the bad answers flagged and of the good answers flagged (None: none of them)."""
    def share(sel):
        return float(np.mean(flagged[sel])) if sel.any() else None
    return {"bad_flagged": share(bad), "good_flagged": share(~bad)}


def best_split(score: np.ndarray, bad: np.ndarray) -> dict | None:
    """The threshold on ``score`` (flag above) that maximises bad flagged - good flagged
    (Youden's J; 1: a perfect split, 0: no better than chance), or None if one class is
    empty."""
    if bad.all() or not bad.any():
        return None
    best = (-1.0, None)
    for t in np.unique(score):
        flag = score >= t
        j = float(np.mean(flag[bad]) - np.mean(flag[~bad]))
        best = max(best, (j, float(t)), key=lambda v: v[0])
    return {"J": best[0], "threshold": best[1]}


def summary(d: dict, bad_at: float, threshold: float, loss_max: float | None) -> dict:
    err, bad = d["error"], d["error"] > bad_at
    signals = {"residual": d["residual"] > threshold,
               "fields_out_of_range": d["fields_out_of_range"],
               "params_out_of_range": d["params_out_of_range"]}
    if loss_max is not None:
        signals["loss"] = d["loss"] > loss_max
    return {"n": int(len(err)), "n_bad": int(bad.sum()),
            "error": {"mean": float(err.mean()), "median": float(np.median(err)),
                      "worst": float(err.max())},
            "residual": {"min": float(d["residual"].min()),
                         "median": float(np.median(d["residual"])),
                         "max": float(d["residual"].max())},
            "flags": {k: shares(v, bad) for k, v in signals.items()},
            "best_split": {k: best_split(d[k], bad) for k in SCORES if d[k] is not None},
            "seconds_per_sample": d["seconds_per_sample"]}


def rows(d: dict) -> list[dict]:
    keys = [k for k in ("error", *SCORES, "fields_out_of_range", "params_out_of_range")
            if d[k] is not None]
    return [{k: (bool(d[k][i]) if d[k].dtype == bool else float(d[k][i])) for k in keys}
            for i in range(len(d["error"]))]


def measure(args) -> dict:
    trained = Family(args.run, {})
    cfg = (trained.meta.get("config") or {}).get("data") or {}
    seed = args.seed if args.seed is not None else int(cfg.get("test_seed", 271828))
    p = trained.problem
    threshold = args.threshold if args.threshold is not None else p.residual_threshold
    if threshold is None:
        raise SystemExit(f"problem {p.name!r} has no residual_threshold; give --threshold")
    ranges = channel_ranges(p, p.sample_params(int(cfg.get("seed", 0)), range(64)))
    bounds = p.param_bounds()
    out = {"command": args.command, "checkpoint": trained.path, "problem": p.name,
           "grid": list(p.grid), "seed": seed, "bad": args.bad, "threshold": threshold,
           "families": {}}
    loss_max = None
    if args.calibrate:
        eval_seed = int(cfg.get("eval_seed", 12345))
        cal = draws(trained, p.sample_params(eval_seed, range(args.calibrate)), args.batch,
                    ranges, bounds)
        loss_max = float(cal["loss"].max())
        out["calibration"] = {"seed": eval_seed, "n": args.calibrate,
                              "residual_max": float(cal["residual"].max()),
                              "residual_median": float(np.median(cal["residual"])),
                              "error_max": float(cal["error"].max()),
                              "loss_max": loss_max, "rows": rows(cal)}
    every = []
    for name, options in args.families:
        fam = trained if not options else Family(args.run, options)
        d = draws(fam, fam.problem.sample_params(seed, range(args.samples)), args.batch,
                  ranges, bounds)
        every.append(d)
        s = summary(d, args.bad, threshold, loss_max)
        out["families"][name] = {"options": options, **s, "rows": rows(d)}
        fl = s["flags"]["residual"]
        print(f"{name:>16}: error mean {s['error']['mean']:.2%} worst {s['error']['worst']:.2%}"
              f", {s['n_bad']}/{s['n']} bad; residual median {s['residual']['median']:.3g}; "
              f"flagged: bad {fl['bad_flagged']}, good {fl['good_flagged']}", file=sys.stderr,
              flush=True)
    pooled = {k: (np.concatenate([d[k] for d in every]) if every[0][k] is not None else None)
              for k in every[0] if k != "seconds_per_sample"}
    out["pooled"] = summary({**pooled, "seconds_per_sample": None}, args.bad, threshold,
                            loss_max)
    return out


def main(argv=None) -> int:
    args = parse(argv)
    emit_json(measure(args), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
