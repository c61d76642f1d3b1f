"""The benchmark of families users bring (issue #68): each example family of
``examples/families`` trained with the plain squared residual and with the multilevel norm, same
steps, seeds and threads, then evaluated on the test draw against the family's own reference.

    python -m lab.tools.family_benchmark --families adr --grids 64 --steps 2048 --out runs/fb
    python -m lab.tools.family_benchmark --report runs/fb          # the table of what finished

An arm is (family, grid, norm): ``deepfusion train examples/families/FAMILY.toml`` with
``problem.grid``, ``problem.options.norm`` and ``train.max_steps`` set (the built-in
Poisson, ``poisson``: its recipe ``configs/recipes/poisson.toml`` in residual form with that
``residual_norm``, or its energy form, norm ``energy``), then ``deepfusion
evaluate RUN --samples N``. Arms run one after the other; an arm whose evaluation exists is
skipped and one whose training was cut short (a session's end) is resumed with ``train
--resume``, so the benchmark can span sessions. Each arm's row (test mean / median / worst,
draws, steps, training wall time summed over its segments, the commands) is written to
``OUT/ARM.json``; ``--report`` prints the table of all of them.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

import numpy as np

# family: (its config, grid axes); "poisson" is the built-in's recipe, whose "norm" may also be
# "energy" (its recipe's loss) and otherwise picks the residual form's residual_norm
FAMILIES = {"adr": ("examples/families/adr.toml", 2),
            "helmholtz": ("examples/families/helmholtz.toml", 2),
            "anisotropic": ("examples/families/anisotropic.toml", 2),
            "diffusion3d": ("examples/families/diffusion3d.toml", 3),
            "poisson": ("configs/recipes/poisson.toml", 2)}
NORMS = ("l2", "multilevel")          # the default arms; "operator" and "vcycle" also work


def norm_settings(family: str, norm: str) -> list[str]:
    """The --set arguments that choose ``norm`` for ``family``."""
    if family != "poisson":
        return ["--set", f'problem.options.norm="{norm}"']
    if norm == "energy":
        return ["--set", 'problem.options.loss="energy"']
    return ["--set", 'problem.options.loss="residual"',
            "--set", f'problem.options.residual_norm="{norm}"']


def arm_name(family: str, grid: int, norm: str) -> str:
    return f"{family}_{grid}_{norm}"


def env() -> dict:
    here = os.getcwd()
    path = os.pathsep.join([os.path.join(here, "examples", "families"), here])
    return dict(os.environ, PYTHONPATH=path)


def train_command(args, family: str, grid: int, norm: str, run_dir: str,
                  fresh: bool = False) -> list[str]:
    """The arm's training command: a resume where the run has checkpoints, unless ``fresh``
    (the command that starts it, as the row records it)."""
    config, dims = FAMILIES[family]
    cmd = [sys.executable, "-m", "deepfusion", "train"]
    if not fresh and os.path.exists(os.path.join(run_dir, "checkpoints")):
        cmd += ["--resume", run_dir]
    else:
        cmd += [config, "--set", f"run.dir={run_dir}"]
    return cmd + ["--set", f"problem.grid=[{', '.join([str(grid)] * dims)}]",
                  *norm_settings(family, norm),
                  "--set", f"train.max_steps={args.steps}",
                  "--set", f"parallel.threads_per_rank={args.threads}",
                  "--set", "run.plots=false", *args.set]


def run(cmd: list[str], log: str, environ: dict) -> float:
    """Run ``cmd`` in ``environ``, its output appended to ``log``; the wall time in seconds."""
    start = time.perf_counter()
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=environ, check=True)
    return time.perf_counter() - start


def test_errors(run_dir: str) -> dict:
    """The run's newest ``evaluate`` file and its relative L2 errors: draws, mean, median,
    worst."""
    (path,) = sorted(glob.glob(os.path.join(run_dir, "eval_seed*.json")))[-1:]
    with open(path) as f:
        e = np.asarray(json.load(f)["rel_l2"], float)
    return {"draws": int(e.size), "mean": float(e.mean()), "median": float(np.median(e)),
            "worst": float(e.max()), "eval_file": path}


def finished_steps(run_dir: str) -> int:
    """The last step recorded in the run's metrics (0 for none)."""
    last = 0
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            for line in f:
                try:
                    last = max(last, int(json.loads(line).get("step", 0)))
                except (ValueError, AttributeError):
                    continue
    except FileNotFoundError:
        pass
    return last


def arm(args, family: str, grid: int, norm: str) -> dict | None:
    name = arm_name(family, grid, norm)
    row_path = os.path.join(args.out, name + ".json")
    if os.path.exists(row_path):
        with open(row_path) as f:
            return json.load(f)
    run_dir, log = os.path.join(args.out, name), os.path.join(args.out, name + ".log")
    wall_path = os.path.join(args.out, name + ".wall")
    wall = float(open(wall_path).read()) if os.path.exists(wall_path) else 0.0
    if finished_steps(run_dir) < args.steps:
        train = train_command(args, family, grid, norm, run_dir)
        wall += run(train, log, env())
        with open(wall_path, "w") as f:
            f.write(repr(wall))
    evaluate = [sys.executable, "-m", "deepfusion", "evaluate", run_dir,
                "--samples", str(args.samples)]
    run(evaluate, log, env())
    steps = finished_steps(run_dir)
    if steps < args.steps:
        print(f"{name}: trained {steps} steps, not {args.steps}: the config's train.epochs "
              f"ends it first (add --set train.epochs=N)", file=sys.stderr)
    row = {"arm": name, "family": family, "grid": grid, "norm": norm, **test_errors(run_dir),
           "steps": steps, "threads": args.threads, "train_wall_s": wall,
           "overrides": args.set,
           "commands": [" ".join(train_command(args, family, grid, norm, run_dir, fresh=True)[1:]),
                        " ".join(evaluate[1:])]}
    with open(row_path, "w") as f:
        json.dump(row, f, indent=1)
    return row


def report(out: str) -> None:
    rows = []
    for path in sorted(glob.glob(os.path.join(out, "*.json"))):
        with open(path) as f:
            row = json.load(f)
        if "arm" in row:
            rows.append(row)
    print("| family | grid | residual measured by | test mean / median / worst (draws) | steps "
          "| training wall time |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['family']} | {r['grid']} | {r['norm']} | {100 * r['mean']:.2f}% / "
              f"{100 * r['median']:.2f}% / {100 * r['worst']:.2f}% ({r['draws']}) | {r['steps']} "
              f"| {r['train_wall_s'] / 60:.1f} min, {r['threads']} thread(s) |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES), help=f"of {list(FAMILIES)}")
    p.add_argument("--grids", default="64", help="nodes per axis, comma-separated")
    p.add_argument("--norms", default=",".join(NORMS),
                   help=f"of {list(NORMS)}; for poisson also energy")
    p.add_argument("--steps", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--samples", type=int, default=64, help="test draws evaluated")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a further config override for every arm (repeatable)")
    p.add_argument("--out", default="runs/family_benchmark")
    p.add_argument("--report", metavar="OUT", help="print the table of OUT's finished arms")
    args = p.parse_args(argv)
    if args.report:
        report(args.report)
        return 0
    args.set = [x for v in args.set for x in ("--set", v)]
    os.makedirs(args.out, exist_ok=True)
    for family in args.families.split(","):
        for grid in (int(g) for g in args.grids.split(",")):
            for norm in args.norms.split(","):
                r = arm(args, family, grid, norm)
                print(f"{r['arm']}: mean {100 * r['mean']:.2f}% median {100 * r['median']:.2f}% "
                      f"worst {100 * r['worst']:.2f}% ({r['draws']} draws), {r['steps']} steps, "
                      f"{r['train_wall_s']:.0f} s", flush=True)
    report(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
