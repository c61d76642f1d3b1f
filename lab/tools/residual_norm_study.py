"""The built-in Poisson in residual form, its residual measured two ways, side by side: the mean
square (``residual_norm = "l2"``) and the multilevel norm (``"multilevel"``,
``diffnet.problems.residual_norm``), with the same steps, seeds and threads (issue #68).

    python -m lab.tools.residual_norm_study --grid 32 --steps 400 --out runs/rn32

For each arm, one after the other (one process, one thread): ``deepfusion train
configs/poisson.toml`` with the residual loss and that norm, then ``deepfusion evaluate RUN
--samples N`` on the test draw. Prints one line per arm (mean / median / worst relative L2,
steps, training wall time, the commands) and writes them as JSON to ``OUT/study.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from lab.tools import family_benchmark

ARMS = ("l2", "multilevel")


def train_command(grid: int, steps: int, norm: str, run_dir: str, extra) -> list[str]:
    options = (f'problem.options={{n_terms = 4, omega_range = [-3.0, 3.0], loss = "residual", '
               f'residual_norm = "{norm}"}}')
    return [sys.executable, "-m", "deepfusion", "train", "configs/poisson.toml",
            "--set", f"problem.grid=[{grid}, {grid}]", "--set", options,
            "--set", f"train.max_steps={steps}", "--set", "parallel.threads_per_rank=1",
            "--set", "run.plots=false", "--set", f"run.dir={run_dir}", *extra]


def run(cmd: list[str], log: str) -> float:
    """Run ``cmd`` in one thread without MPI, its output appended to ``log``; the wall time."""
    return family_benchmark.run(cmd, log, dict(os.environ, OMP_NUM_THREADS="1",
                                                DEEPFUSION_NO_MPI="1"))


def arm(args, norm: str) -> dict:
    """Train and evaluate one arm; its errors on the test draw."""
    run_dir = os.path.join(args.out, norm)
    log = run_dir + ".log"
    train = train_command(args.grid, args.steps, norm, run_dir, args.set)
    evaluate = [sys.executable, "-m", "deepfusion", "evaluate", run_dir,
                "--samples", str(args.samples)]
    wall = run(train, log)
    run(evaluate, log)
    return {"norm": norm, **family_benchmark.test_errors(run_dir), "steps": args.steps,
            "train_wall_s": wall,
            "commands": [" ".join(train[1:]), " ".join(evaluate[1:])]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", type=int, default=32)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--samples", type=int, default=64, help="test draws evaluated")
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated, of " + str(ARMS))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a further config override for both arms (repeatable)")
    p.add_argument("--out", default="runs/residual_norm_study")
    args = p.parse_args(argv)
    args.set = [x for v in args.set for x in ("--set", v)]
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for norm in args.arms.split(","):
        rows.append(arm(args, norm))
        r = rows[-1]
        print(f"{r['norm']:>10}: {r['draws']} draws, relative L2 mean {100 * r['mean']:.2f}% "
              f"median {100 * r['median']:.2f}% worst {100 * r['worst']:.2f}%, "
              f"{r['steps']} steps, {r['train_wall_s']:.0f} s", flush=True)
    with open(os.path.join(args.out, "study.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
