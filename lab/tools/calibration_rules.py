"""The answer check's calibration rules side by side on the same draws (issue #68).

    python -m lab.tools.calibration_rules RUN STUDY.json [STUDY.json ...] \\
        [--validation EVAL.json] [--out FILE.json]

The threshold of each rule is calibrated on the run's validation draws (``--validation``,
default RUN/eval.json: the residual and the error of each draw of the training's final
validation, ``data.eval_seed``) by ``deepfusion.engine.predict.calibration.calibrate``: the
ratio rule (slope fixed at 1: 10% quantile of residual / error, times 5%) and the fitted rule
(the slope of log residual against log error fitted on the same draws). Each threshold then
flags the draws of every set of each STUDY.json (``lab.tools.answer_check_study``'s output:
each draw's residual and error) and of the validation draws themselves. Per rule and set: the
threshold, bad answers (error above the study's ``error``) flagged, good answers flagged
(false alarms). A markdown table on stdout, the JSON to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from bench.common import command_line, emit_json

RULES = {"ratio (slope 1)": 1.0, "fitted slope": None}


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m lab.tools.calibration_rules",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("run", help="run directory (its eval.json: the final validation)")
    ap.add_argument("studies", nargs="+", help="answer_check_study JSON files of this run")
    ap.add_argument("--validation", help="default: RUN/eval.json")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    args.validation = args.validation or os.path.join(args.run, "eval.json")
    args.command = command_line(ap.prog, argv)
    return args


def counts(residual, error, threshold: float, error_at: float) -> dict:
    """Bad (error above ``error_at``) and good answers, and how many of each are flagged."""
    r, e = np.asarray(residual, dtype=np.float64), np.asarray(error, dtype=np.float64)
    bad, flagged = e > error_at, ~(r <= threshold)
    return {"n": int(e.size), "bad": int(bad.sum()), "bad_flagged": int((bad & flagged).sum()),
            "good": int((~bad).sum()), "false_alarms": int((~bad & flagged).sum()),
            "error_mean": float(e.mean()), "error_worst": float(e.max())}


def compare(validation: dict, studies: list[dict]) -> dict:
    """Each rule's calibration on ``validation`` (residual, rel_l2) and its flags on the
    validation draws and on every set of every study."""
    from deepfusion.engine.predict.calibration import calibrate

    r, e = validation["residual"], validation["rel_l2"]
    out = {"validation_seed": validation.get("seed"), "rules": {}}
    for name, slope in RULES.items():
        cal = calibrate(r, e, slope=slope)
        t = cal["threshold"]
        sets = {"validation": counts(r, e, t, cal["error"])}
        for i, s in enumerate(studies):
            for key, got in s["sets"].items():
                rows = got["rows"]
                label = key if len(studies) == 1 else f"{i}:{key}"
                sets[label] = counts([w["residual"] for w in rows], [w["error"] for w in rows],
                                     t, s["error"])
        out["rules"][name] = {"threshold": t, "slope": cal["slope"], "level": cal["level"],
                              "separation": cal["separation"], "sets": sets}
    return out


def table(res: dict) -> str:
    lines = ["| rule | threshold (slope) | draws | error mean / worst | bad flagged | "
             "false alarms |", "|---|---|---|---|---|---|"]
    for name, rule in res["rules"].items():
        for label, c in rule["sets"].items():
            lines.append(f"| {name} | {rule['threshold']:.3g} ({rule['slope']['used']:.2f}) | "
                         f"{label} ({c['n']}) | {c['error_mean']:.2%} / {c['error_worst']:.2%}"
                         f" | {c['bad_flagged']} of {c['bad']} | {c['false_alarms']} of "
                         f"{c['good']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse(argv)
    with open(args.validation) as f:
        validation = json.load(f)
    studies = []
    for path in args.studies:
        with open(path) as f:
            studies.append(json.load(f))
    res = {"command": args.command, "run": args.run, "validation": args.validation,
           "studies": args.studies, **compare(validation, studies)}
    print(table(res))
    if args.out:
        emit_json(res, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
