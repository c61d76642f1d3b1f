"""Ablations on one held-out set: stencil kinds, residual vs energy loss, hard vs soft boundaries.

    python -m lab.tools.ablation_bench --out bench/out/ablation.json [--only NAME,...]
                                   [--poisson-steps 960] [--burgers-steps 320] [--threads 2]
                                   [--seeds 0[,1,...]]

Every variant is ``deepfusion train`` on a recipe (``configs/recipes``) with one option changed
and the same step budget, initialisation and training pool, one process after another on the
same machine. The record is the accuracy on the **test draw** (``deepfusion evaluate``:
``data.test_samples`` = 64 draws of ``data.test_seed``, never used for tuning; mean / median /
worst relative L2 against the reference solver), the validation draw's (``eval.json``,
``data.eval_seed``, which the recipes were tuned on) beside it, and the training wall time.
``--seeds 0,1`` runs every variant once per initialisation (``train.init_seed``): the
run-to-run spread that a variant's difference must exceed to count (e.g. bf16 against fp32).

Variants:
  * Poisson, energy loss in bf16 (``train.precision = "bf16"``; fails with the reason on a CPU
    without AVX512-BF16/AMX, recorded as an error).
  * Poisson, residual loss, stencil ``sobel`` ([1,2,1] smoothing), ``sobel3103`` (the talk's
    [3,10,3]) and ``central`` (plain 3-point differences); and the energy loss (the recipe).
  * Burgers: the Lax-Oleinik loss (the recipe, ``burgers.toml``) in fp32 and bf16, with and
    without its annealed smoothing, hard vs soft boundary values, with the basin term
    (``basin_weight`` 0.03 / 0.1 / 0.3 / 1, ``basin_reach`` 2 or 4); the MUSCL residual (``burgers_muscl.toml``), hard
    (u0 and the inflow written exactly) vs soft (penalty terms, weight ``bc_weight``); and the
    central ``sobel`` residual, hard vs soft.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.common import ROOT, emit_json

RECIPES = os.path.join(ROOT, "configs", "recipes")

VARIANTS = {
    "poisson_energy": ("poisson.toml", []),
    "poisson_energy_bf16": ("poisson.toml", ['train.precision="bf16"']),
    "poisson_residual_sobel": ("poisson.toml", ['problem.options.loss="residual"',
                                                'problem.options.stencil="sobel"']),
    "poisson_residual_sobel3103": ("poisson.toml", ['problem.options.loss="residual"',
                                                    'problem.options.stencil="sobel3103"']),
    "poisson_residual_central": ("poisson.toml", ['problem.options.loss="residual"',
                                                  'problem.options.stencil="central"']),
    "burgers_lax_oleinik": ("burgers.toml", []),
    "burgers_lax_oleinik_bf16": ("burgers.toml", ['train.precision="bf16"']),
    "burgers_lax_oleinik_unsmoothed": ("burgers.toml", ["problem.options.smoothing=0.0"]),
    "burgers_lax_oleinik_soft": ("burgers.toml", ["problem.options.hard_bc=false"]),
    "burgers_lax_oleinik_basin": ("burgers.toml", ["problem.options.basin_weight=1.0"]),
    "burgers_lax_oleinik_basin01": ("burgers.toml", ["problem.options.basin_weight=0.1"]),
    "burgers_lax_oleinik_basin03": ("burgers.toml", ["problem.options.basin_weight=0.3"]),
    "burgers_lax_oleinik_basin003": ("burgers.toml", ["problem.options.basin_weight=0.03"]),
    "burgers_lax_oleinik_basin01_reach4": ("burgers.toml", ["problem.options.basin_weight=0.1",
                                                            "problem.options.basin_reach=4"]),
    "burgers_muscl_hard": ("burgers_muscl.toml", []),
    "burgers_muscl_soft": ("burgers_muscl.toml", ["problem.options.hard_bc=false"]),
    "burgers_sobel_hard": ("burgers_muscl.toml", ['problem.options.scheme="stencil"',
                                                  "problem.options.horizon=1"]),
    "burgers_sobel_soft": ("burgers_muscl.toml", ['problem.options.scheme="stencil"',
                                                  "problem.options.horizon=1",
                                                  "problem.options.hard_bc=false"]),
}


def run_variant(name: str, args, tmp: str, seed: int = 0) -> dict:
    recipe, sets = VARIANTS[name]
    steps = args.poisson_steps if recipe == "poisson.toml" else args.burgers_steps
    run_dir = os.path.join(tmp, name if seed == 0 else f"{name}_seed{seed}")
    sets = sets + [f"train.init_seed={seed}", f"train.max_steps={steps}", "train.epochs=1000", f"run.dir={run_dir}",
                   f"parallel.threads_per_rank={args.threads}", "train.eval_every_epochs=0",
                   "train.log_every=100000", "run.progress=log"]
    cmd = [sys.executable, "-m", "deepfusion", "train", os.path.join(RECIPES, recipe),
           "--overwrite"] + [a for s in sets for a in ("--set", s)]
    env = dict(os.environ, PYTHONPATH=ROOT, DEEPFUSION_NO_MPI="1")
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        return {"name": name, "error": p.stderr.strip().splitlines()[-3:]}
    test_json = os.path.join(run_dir, "test.json")
    q = subprocess.run([sys.executable, "-m", "deepfusion", "evaluate", run_dir, "--out", test_json,
                        "--threads", str(args.threads)], cwd=ROOT, env=env, capture_output=True,
                       text=True)
    if q.returncode != 0:
        return {"name": name, "error": q.stderr.strip().splitlines()[-3:]}
    keys = ("n", "seed", "rel_l2_mean", "rel_l2_median", "rel_l2_max")
    with open(os.path.join(run_dir, "eval.json")) as f:
        val = json.load(f)
    with open(test_json) as f:
        test = json.load(f)
    return {"name": name, "recipe": recipe, "overrides": VARIANTS[name][1], "steps": steps,
            "init_seed": seed, "wall_s": wall, **{k: test[k] for k in keys},
            "validation": {k: val[k] for k in keys}}


def parse_seeds(p: argparse.ArgumentParser, text: str) -> list[int]:
    """"0,1" -> [0, 1]; a usage error naming the value unless all are integers >= 0."""
    try:
        seeds = [int(v) for v in text.split(",")]
    except ValueError:
        p.error(f"--seeds takes a comma list of integers >= 0, got {text!r}")
    if any(v < 0 for v in seeds):
        p.error(f"--seeds takes integers >= 0, got {text!r}")
    return seeds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/out/ablation.json")
    p.add_argument("--only", default="", help="comma list of variants (default: all)")
    p.add_argument("--poisson-steps", type=int, default=960)
    p.add_argument("--burgers-steps", type=int, default=320)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", default="runs/ablation", help="where the runs' directories go")
    p.add_argument("--seeds", default="0", help="comma list of train.init_seed values; every "
                   "variant runs once per seed (the run-to-run spread)")
    args = p.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(VARIANTS)
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        p.error(f"unknown variant(s) {bad}; valid: {', '.join(VARIANTS)}")
    out = {"machine": {"cpu_count": os.cpu_count(), "loadavg_start": os.getloadavg()},
           "results": []}
    os.makedirs(args.runs, exist_ok=True)
    seeds = parse_seeds(p, args.seeds)
    for name in names:
        for seed in seeds:
            rec = run_variant(name, args, args.runs, seed)
            out["results"].append(rec)
            print(json.dumps(rec), flush=True)
    out["machine"]["loadavg_end"] = os.getloadavg()
    emit_json(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
