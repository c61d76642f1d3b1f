"""Held-out error against wall time of training runs, and the speed-up of one run over another.

    python -m lab.tools.error_vs_time RUN_DIR [RUN_DIR ...] [--draws 64] [--seed TEST_SEED]
                                  [--baseline RUN_DIR] [--goal 3] [--stride N]
                                  [--out bench/out/error_vs_time.json]

Every kept checkpoint of each run (``train.keep_checkpoints``, ``train.checkpoint_every``) that
was written on the run's final grid is evaluated on the same draws (default: 64 draws of the
first run's ``data.test_seed``, the test draw no run was tuned on), with the wall time the
checkpoint records (``elapsed_s``: the trajectory's time, summed over resumed segments). A
multigrid run's checkpoints on coarser levels are skipped: the question is the error on the
final grid. ``--stride N`` evaluates every N-th kept checkpoint and always the last (each one
is a forward pass over all the draws on the final grid: a long run at 512x512 keeps dozens).

With ``--baseline`` (e.g. the single-grid run), the speed-up of each other run is the
baseline's time to first reach that run's final mean error, over that run's total time; if the
baseline never reaches it, the speed-up is at least its total time over the run's ("> x").
The goal (``--goal``, default 3x) is printed as met / not met.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys

import numpy as np
import torch

from bench.common import emit_json


def checkpoints(run_dir: str, stride: int = 1) -> list[str]:
    """The run's kept checkpoints in step order: every ``stride``-th, and always the last."""
    paths = sorted(glob.glob(os.path.join(run_dir, "checkpoints", "step_*.h5")))
    return [p for i, p in enumerate(paths) if i % stride == 0 or i == len(paths) - 1]


def final_grid(run_dir: str) -> tuple:
    from deepfusion.config import load_config
    return tuple(load_config(os.path.join(run_dir, "config.toml")).problem.grid)


def draws(run_dir: str, n: int, seed):
    """(problem on the final grid, params, references) of the evaluation draws."""
    from deepfusion.engine.predict.loader import load_model
    from deepfusion.config import load_config

    _, prob, _, _ = load_model(checkpoints(run_dir)[-1], grid=final_grid(run_dir))
    seed = load_config(os.path.join(run_dir, "config.toml")).data.test_seed if seed is None else seed
    params = prob.sample_params(seed, np.arange(n))
    refs = np.stack([prob.reference_solution(q) for q in params])
    return prob, params, refs, seed


def errors(model, prob, params, refs, chunk: int = 8) -> np.ndarray:
    """Relative L2 of the network's answers to ``params`` against ``refs``, ``chunk`` at a time."""
    from diffnet.metrics import relative_l2

    errs = []
    with torch.no_grad():
        for i in range(0, len(params), chunk):
            x = prob.build_input(params[i:i + chunk]).to(next(model.parameters()).dtype)
            u = prob.answer(model(x), x)[:, 0].double().numpy()
            errs.append(relative_l2(u, refs[i:i + chunk]))
    return np.concatenate(errs)


def curve(run_dir: str, prob, params, refs, chunk: int = 8, stride: int = 1) -> list[dict]:
    """Error of every ``stride``-th checkpoint (and the last) on the final grid, in step order.
    With a stride > 1 the striding applies before the coarse-grid checkpoints are skipped."""
    from deepfusion.engine.predict.loader import load_model

    points = []
    for path in checkpoints(run_dir, stride):
        model, _p, _w, meta = load_model(path, grid=tuple(prob.grid))
        if tuple(meta.get("grid", prob.grid)) != tuple(prob.grid):
            continue
        e = errors(model, prob, params, refs, chunk)
        points.append({"checkpoint": os.path.basename(path), "step": int(meta["step"]),
                       "elapsed_s": float(meta.get("elapsed_s", float("nan"))),
                       "mean": float(e.mean()), "median": float(np.median(e)),
                       "worst": float(e.max())})
        print(f"{run_dir}: step {points[-1]['step']:6d} {points[-1]['elapsed_s']:8.0f} s  "
              f"mean {e.mean():.4f} median {np.median(e):.4f} worst {e.max():.4f}", flush=True)
    return points


def speedup(base: list[dict], run: list[dict], goal: float) -> dict:
    """The baseline's time to reach ``run``'s final mean error, over ``run``'s time."""
    target, t_run = run[-1]["mean"], run[-1]["elapsed_s"]
    reached = [p for p in base if p["mean"] <= target]
    if reached:
        s, bound = reached[0]["elapsed_s"] / t_run, "="
    else:
        s, bound = base[-1]["elapsed_s"] / t_run, ">"
    return {"target_mean": target, "run_s": t_run, "speedup": s, "bound": bound,
            "goal": goal, "met": s >= goal}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+")
    p.add_argument("--baseline", default="")
    p.add_argument("--draws", type=int, default=64)
    p.add_argument("--seed", type=int, default=None, help="default: data.test_seed of the runs")
    p.add_argument("--goal", type=float, default=3.0)
    p.add_argument("--stride", type=int, default=1,
                   help="evaluate every N-th kept checkpoint (and always the last)")
    p.add_argument("--out", default="bench/out/error_vs_time.json")
    a = p.parse_args(argv)
    if a.stride < 1:
        p.error(f"--stride must be >= 1, got {a.stride}")
    torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    runs = a.runs + ([a.baseline] if a.baseline and a.baseline not in a.runs else [])
    grids = {final_grid(r) for r in runs}
    if len(grids) != 1:
        p.error(f"the runs end on different grids {sorted(grids)}: compare runs of one grid")
    prob, params, refs, seed = draws(runs[0], a.draws, a.seed)
    res = {"grid": list(prob.grid), "draws": a.draws, "seed": seed, "runs": {}}
    for r in runs:
        res["runs"][r] = curve(r, prob, params, refs, stride=a.stride)
    if a.baseline:
        res["speedup"] = {}
        for r in a.runs:
            if r == a.baseline or not res["runs"][r]:
                continue
            s = speedup(res["runs"][a.baseline], res["runs"][r], a.goal)
            res["speedup"][r] = s
            print(f"{r}: final mean {s['target_mean']:.4f} in {s['run_s']:.0f} s; the baseline "
                  f"needs {s['bound']} {s['speedup']:.2f}x that time: goal >= {a.goal:g}x "
                  f"{'met' if s['met'] else 'not met'}")
    emit_json(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
