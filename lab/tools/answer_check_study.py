"""Does the answer check flag a trained model's bad answers, in its family and outside it?

    python -m lab.tools.answer_check_study RUN [--samples 32] [--seed S] \\
        [--set problem.options.KEY=VALUE ...] [--widen F] [--error 0.05] [--batch 8] \\
        [--out FILE.json]

RUN is a run directory (its newest complete checkpoint) or a checkpoint. Two sets of
``--samples`` draws of ``--seed`` (default: the run's ``data.test_seed``, never trained nor
tuned on), each answered by the network (``diffnet.answer.Answer``: network, boundary
imposition, answer head) on the training grid and by the reference solver:

* "in": the trained family, as the checkpoint stores it;
* "out": the family the ``--set problem.options.KEY=VALUE`` flags make of it (VALUE in TOML,
  as ``deepfusion infer --set``: e.g. ``problem.options.max_speed=8``), with each parameter
  drawn from its trained interval widened by ``--widen`` F times its width on each side
  (draw j of seed s from its own generator, as ``Problem.sample_params``). At least one of
  the two is needed.

Per draw: ``error`` (relative L2 to the reference), ``residual`` (``Problem.answer_residual``,
what ``infer`` checks), ``flagged`` (above the threshold the checkpoint gives predictions:
``deepfusion.engine.predict.calibration.threshold_for``, its calibrated one or the fallback,
recorded with its source) and, for a family with a residual of its own, ``loss_residual`` (the
one derived from its loss, ``diffnet.problems.loss_residual``) beside it. An answer is bad when
its error is above ``--error``. Per set and pooled: the share of the bad answers flagged
(higher is better), the false alarms (good answers flagged: their count and share, lower is
better), the errors and residuals, and the best split of each residual (Youden's J, the
threshold that would have separated them best). JSON to ``--out`` (default stdout); one line
per set on stderr.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from bench.common import command_line, emit_json
from lab.tools.residual_flags import Family


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m lab.tools.answer_check_study",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("run", help="run directory or checkpoint file")
    ap.add_argument("--samples", type=int, default=32, help="draws per set (default 32)")
    ap.add_argument("--seed", type=int, help="default: the run's data.test_seed")
    ap.add_argument("--set", action="append", default=[], metavar="problem.options.KEY=VALUE",
                    help="an option of the out-of-family problem (repeatable)")
    ap.add_argument("--widen", type=float, default=0.0, metavar="F",
                    help="out-of-family parameters from their trained intervals widened by F "
                         "times the width on each side (default 0)")
    ap.add_argument("--error", type=float, default=0.05, help="relative L2 above which an "
                                                              "answer is bad (default 0.05)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.samples < 1 or args.batch < 1 or args.widen < 0 or not 0 < args.error < 1:
        ap.error("--samples and --batch must be >= 1, --widen >= 0, --error in (0, 1)")
    from deepfusion.app.options import set_options

    try:
        args.options = set_options(args.set, "answer_check_study")
    except ValueError as e:
        ap.error(str(e))
    if not args.options and args.widen == 0:
        ap.error("say how the out-of-family draws differ: --set problem.options.KEY=VALUE "
                 "and/or --widen F")
    args.command = command_line(ap.prog, argv)
    return args


# the checkpoint's network answering one problem: the one residual_flags reads
Model = Family


def widened_draws(problem, seed: int, n: int, widen: float) -> np.ndarray:
    """(n, k) parameter vectors, draw j from the generator of (seed, j) as
    ``Problem.sample_params``, each parameter uniform on its trained interval widened by
    ``widen`` times its width on each side."""
    bounds = np.asarray(problem.param_bounds(), dtype=np.float64)
    width = bounds[:, 1] - bounds[:, 0]
    lo, hi = bounds[:, 0] - widen * width, bounds[:, 1] + widen * width
    return np.stack([lo + (hi - lo) * np.random.default_rng([int(seed), j]).random(len(lo))
                     for j in range(n)])


def draws(m: Model, params: np.ndarray, batch: int, threshold) -> dict:
    """Per-draw error, residual(s) and flag of the model's answers to ``params``."""
    from diffnet.problems import loss_residual, residual_kind

    p = m.problem
    u, x, _ = m.answers(params, batch)
    residual = np.asarray(p.answer_residual(u, x), dtype=np.float64)
    ref = np.stack([p.reference_solution(q) for q in params])
    got = u[:, 0].numpy()
    error = (np.linalg.norm((got - ref).reshape(len(ref), -1), axis=1)
             / np.linalg.norm(ref.reshape(len(ref), -1), axis=1))
    out = {"error": error, "residual": residual, "flagged": threshold.flags(residual)}
    if residual_kind(p) == "family":
        out["loss_residual"] = loss_residual(p, u, x)
    return out


def best_split(score: np.ndarray, bad: np.ndarray) -> dict | None:
    """The threshold on ``score`` (flag above or equal) maximising bad flagged - good flagged
    (Youden's J), or None if one class is empty."""
    if bad.all() or not bad.any():
        return None
    score = np.where(np.isfinite(score), score, np.inf)
    best = (-2.0, None)
    for t in np.unique(score):
        flag = score >= t
        j = float(np.mean(flag[bad]) - np.mean(flag[~bad]))
        if j > best[0]:
            best = (j, float(t))
    return {"J": best[0], "threshold": best[1]}


def summary(d: dict, error_at: float) -> dict:
    err, bad, flagged = d["error"], d["error"] > error_at, d["flagged"]
    good = ~bad
    scores = [k for k in ("residual", "loss_residual") if k in d]
    return {"n": int(err.size), "bad": int(bad.sum()),
            "bad_flagged": int((bad & flagged).sum()),
            "bad_flagged_share": float(flagged[bad].mean()) if bad.any() else None,
            "false_alarms": int((good & flagged).sum()),
            "false_alarm_share": float(flagged[good].mean()) if good.any() else None,
            "error": {"mean": float(err.mean()), "median": float(np.median(err)),
                      "worst": float(err.max())},
            **{k: {"min": float(np.nanmin(d[k])), "median": float(np.nanmedian(d[k])),
                   "max": float(np.nanmax(d[k]))} for k in scores},
            "best_split": {k: best_split(d[k], bad) for k in scores}}


def rows(d: dict) -> list[dict]:
    return [{k: (bool(v[i]) if v.dtype == bool else float(v[i])) for k, v in d.items()}
            for i in range(len(d["error"]))]


def measure(args) -> dict:
    from deepfusion.engine.predict.calibration import KEY, threshold_for

    trained = Model(args.run, {})
    data = (trained.meta.get("config") or {}).get("data") or {}
    seed = args.seed if args.seed is not None else int(data.get("test_seed", 271828))
    threshold = threshold_for(trained.meta, trained.problem)
    out = {"command": args.command, "checkpoint": trained.path, "problem": trained.problem.name,
           "grid": list(trained.problem.grid), "seed": seed, "error": args.error,
           "threshold": {"value": threshold.value, "source": threshold.source,
                         "text": threshold.text},
           "calibration": trained.meta.get(KEY), "sets": {}}
    outside = Model(args.run, args.options) if args.options else trained
    sets = {"in": (trained, trained.problem.sample_params(seed, range(args.samples)), {}),
            "out": (outside, widened_draws(outside.problem, seed, args.samples, args.widen),
                    {"options": args.options, "widen": args.widen})}
    every = []
    for name, (m, params, how) in sets.items():
        d = draws(m, params, args.batch, threshold)
        every.append(d)
        s = summary(d, args.error)
        out["sets"][name] = {**how, **s, "rows": rows(d)}
        print(f"{name:>4}: error mean {s['error']['mean']:.2%} worst {s['error']['worst']:.2%}; "
              f"{s['bad_flagged']} of {s['bad']} bad flagged, {s['false_alarms']} of "
              f"{s['n'] - s['bad']} good flagged (threshold {threshold.value}, "
              f"{threshold.source})", file=sys.stderr, flush=True)
    out["pooled"] = summary({k: np.concatenate([d[k] for d in every]) for k in every[0]},
                            args.error)
    return out


def main(argv=None) -> int:
    args = parse(argv)
    emit_json(measure(args), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
