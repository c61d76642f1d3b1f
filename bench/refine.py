"""A network's answer refined by the reference solver, against the solver's cold start.

    python -m bench.refine --out bench/out/refine.json --checkpoint RUN [--sizes 512,1024]
                           [--work-grid trained|none|HxW] [--samples 4] [--seed 7]
                           [--tol 1e-8] [--repeats 3] [--threads 1] [--coarse trained|none|HxW]
                           [--set problem.options.KEY=VALUE ...]
    python -m bench.refine --out OUT --problem darcy --sizes 512 --coarse 128x128

For each grid size N (N x N, or N^3 for a 3-D problem) and each of ``--samples`` draws, one
assembled reference system (``Problem.reference_system``: assembly and AMG setup timed once) is
solved by AMG-preconditioned CG to the relative residual ``--tol``:

* **cold**: from zero, as ``deepfusion solve`` would;
* **warm**: from the network's answer (the checkpoint's model as ``deepfusion infer`` runs it,
  through the prediction service, ``deepfusion.engine.predict.service``: on ``--work-grid`` and
  interpolated, its forward pass timed with the input rendering and resampling);
* **coarse** (control, ``--coarse``; "trained" is the checkpoint's training grid): from the
  exact reference answer of the same draw on the coarse grid, interpolated; the coarse solve
  and the interpolation are timed. It says what the best answer a coarse grid can give buys,
  whatever the network.

Every time is the minimum of ``--repeats`` runs, wall and process CPU seconds (the machine may
be shared: the minimum is the least disturbed; the CPU time of these one-thread steps is less
sensitive to other jobs than the wall time). Problem options (``--set``) replace the
checkpoint's; a Darcy preset is a set of explicit values there, so a family is changed by its
values (``--set problem.options.tau=10`` ...), not by ``family``. The goal, per grid, printed as met or not met, never asserted: the warm
answer (network forward + warm solve, median over the draws) in less time than the cold
solve; the assembly and the AMG setup, the same for both, are reported apart. Without
``--checkpoint`` only the cold and the coarse starts run (``--problem``).
"""
from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

from bench.common import Timer, command_line, emit_json, machine
from deepfusion.app.options import ANSWER_SET_HELP, add_set, problem_options

# the goal: the refined answer sooner than the cold solve, network included (medians
# over the draws, at --tol): cold seconds / (network + warm seconds) above this
GOAL_SPEEDUP = 1.0


def _timed(fn):
    """(fn(), {"s": wall seconds, "cpu_s": process CPU seconds})."""
    with Timer() as t:
        out = fn()
    return out, {"s": t.wall, "cpu_s": t.cpu}


def _setup(a, size: int):
    """(problem on the N grid, model or None, work problem or None, coarse problem or None)."""
    from deepfusion.engine.predict.loader import problem_from_spec, load, resolve_work_grid
    from diffnet.problems import resolve

    options = problem_options(a, "bench.refine")
    model = work = None
    meta: dict = {}
    if a.checkpoint:
        first = load(a.checkpoint, options=options)
        loaded = load(first.path, grid=(size,) * first.problem.dims, work_grid=a.work_grid,
                      options=options)
        model, problem, work, meta = loaded.model, loaded.problem, loaded.work, loaded.meta
    else:
        problem = problem_from_spec(a.problem, options, (size,) * resolve(a.problem).dims)
    problem.check_refine(a.tol)
    coarse_grid = resolve_work_grid(a.coarse, meta) if a.coarse != "trained" or meta else None
    coarse = None if coarse_grid is None else problem_from_spec(type(problem), problem.config(),
                                                            coarse_grid, where="--coarse")
    return problem, model, work, coarse


def _network(model, problem, work, params):
    """answer(j) -> u (*grid) float64: the answer as ``deepfusion infer`` forms it (the
    prediction service's pipeline, one draw a batch: the draw rendered on the work grid, the
    network, the imposition, the interpolation to the grid)."""
    from deepfusion.engine.predict import service
    from deepfusion.engine.predict.pipeline import Samples

    pipe = service.pipeline(model, problem, work=work, channels_last=True)
    compute = service.Predictor(pipe, Samples(params), keep_inputs=False)

    def answer(j):
        return compute(j, j + 1).u[0].double().numpy()
    return answer


def _coarse_answer(coarse, problem, prm):
    """The exact reference answer of the draw on the coarse grid, interpolated to the grid."""
    import torch

    from diffnet.resample import resample_nodes

    u = coarse.reference_solution(prm, "auto")
    return resample_nodes(torch.from_numpy(u)[None, None], problem.grid)[0, 0].numpy()


def _starts(j, prm, problem, answer, coarse) -> dict:
    """name -> the function giving that start's guess (cold: None)."""
    out = {"cold": lambda: None}
    if answer is not None:
        answer(j)           # untimed warm-up: one-off kernel selection stays out of the time
        out["warm"] = lambda: answer(j)
    if coarse is not None:
        out["coarse"] = lambda: _coarse_answer(coarse, problem, prm)
    return out


def _record(info, pre, solve) -> dict:
    rec = {"iterations": info["iterations"], "solve_s": solve["s"],
           "solve_cpu_s": solve["cpu_s"], "residual": info["residual"],
           "initial_residual": info["initial_residual"], "converged": info["converged"]}
    return rec if pre is None else {**rec, "pre_s": pre["s"], "pre_cpu_s": pre["cpu_s"]}


def _draw(a, j, prm, problem, answer, coarse) -> dict:
    """One draw: the system set up once, then every start (its guess, then its solve) in
    turn, ``--repeats`` rounds, so a burst of load from other jobs hits them all alike; the
    minimum of each time over the rounds."""
    import torch

    x = problem.build_input(prm[None], dtype=torch.float64)[0].numpy()
    system = problem.reference_system(x)
    system.hierarchy()
    starts = _starts(j, prm, problem, answer, coarse)
    inf = {"s": float("inf"), "cpu_s": float("inf")}
    best = {name: {"pre": dict(inf), "solve": dict(inf)} for name in starts}
    for _ in range(a.repeats):
        for name, guess in starts.items():
            u0, pre = _timed(guess)
            (u, info), solve = _timed(lambda: system.refine(u0, a.tol))
            b = best[name]
            for what, t in (("pre", pre), ("solve", solve)):
                b[what] = {k: min(b[what][k], t[k]) for k in t}
            b.update(u0=u0, u=u, info=info)
    rec = {"draw": j, "n_unknowns": system.n_unknowns, "assemble_s": system.assemble_time,
           "setup_s": system.setup_time}
    ref = best["cold"]["u"]
    for name, b in best.items():
        rec[name] = _record(b["info"], None if name == "cold" else b["pre"], b["solve"])
        if name != "cold":
            rec[name]["guess_error"] = float(np.linalg.norm(b["u0"] - ref) / np.linalg.norm(ref))
    if coarse is not None:
        rec["coarse"]["coarse_grid"] = list(coarse.grid)
    return rec


def _median(rows, start: str, key: str) -> float:
    return float(statistics.median(r[start][key] for r in rows))


def _summary(rows) -> dict:
    """Medians over the draws; ``total`` = the guess's seconds (``pre``: network forward, or
    coarse solve and interpolation) + the solve's, wall and CPU."""
    out = {"cold": {k: _median(rows, "cold", k) for k in ("iterations", "solve_s",
                                                           "solve_cpu_s")},
           "assemble_s": float(statistics.median(r["assemble_s"] for r in rows)),
           "setup_s": float(statistics.median(r["setup_s"] for r in rows))}
    for start in ("warm", "coarse"):
        if start not in rows[0]:
            continue
        s = {k: _median(rows, start, k) for k in ("iterations", "solve_s", "solve_cpu_s",
                                                  "pre_s", "pre_cpu_s", "guess_error",
                                                  "initial_residual")}
        for unit in ("s", "cpu_s"):
            total = statistics.median(r[start]["pre_" + unit] + r[start]["solve_" + unit]
                                      for r in rows)
            s["total_" + unit] = float(total)
            s["speedup_vs_cold_" + unit] = out["cold"]["solve_" + unit] / total
        out[start] = s
    return out


def run_size(a, size: int) -> dict:
    problem, model, work, coarse = _setup(a, size)
    params = problem.sample_params(a.seed, np.arange(a.samples))
    answer = None if model is None else _network(model, problem, work, params)
    rows = []
    for j, prm in enumerate(params):
        rows.append(_draw(a, j, prm, problem, answer, coarse))
        print(_row_line(size, rows[-1]), flush=True)
    res = {"size": size, "grid": list(problem.grid), "problem": problem.name,
           "problem_kwargs": problem.config(), "rows": rows, "summary": _summary(rows)}
    if work is not None:
        res["work_grid"] = list(work.grid)
    if "warm" in res["summary"]:
        w, c = res["summary"]["warm"], res["summary"]["cold"]
        res["goal"] = {"goal": GOAL_SPEEDUP, "value": w["speedup_vs_cold_s"],
                       "met": bool(w["speedup_vs_cold_s"] > GOAL_SPEEDUP),
                       "value_cpu": w["speedup_vs_cold_cpu_s"],
                       "met_cpu": bool(w["speedup_vs_cold_cpu_s"] > GOAL_SPEEDUP),
                       "warm_s": w["total_s"], "cold_s": c["solve_s"],
                       "warm_cpu_s": w["total_cpu_s"], "cold_cpu_s": c["solve_cpu_s"]}
    return res


def _row_line(size: int, r: dict) -> str:
    line = (f"  {size:5d} draw {r['draw']}: setup {r['setup_s']:.2f} s, cold "
            f"{r['cold']['iterations']} it {r['cold']['solve_s']:.3f} s")
    for start in ("warm", "coarse"):
        if start in r:
            w = r[start]
            line += (f"; {start} {w['iterations']} it {w['solve_s']:.3f} s + {w['pre_s']:.3f} s "
                     f"(guess {100 * w['guess_error']:.2f}% off)")
    return line


def goals(res: dict) -> dict:
    """The goal of every grid, keyed ``refine_speedup_<grid>`` (as ``bench.run`` lists goals):
    value = cold solve seconds / (network forward + warm solve seconds), goal > 1."""
    return {f"refine_speedup_{'x'.join(map(str, r['grid']))}": r["goal"]
            for r in res["sizes"] if "goal" in r}


def goal_lines(res: dict) -> list[str]:
    """One line per grid: the goal as met / not met, wall and CPU seconds."""
    return [f"{k}: warm (network + solve) {g['warm_s']:.3f} s vs cold {g['cold_s']:.3f} s = "
            f"{g['value']:.2f}x ({'met' if g['met'] else 'NOT met'}); CPU {g['warm_cpu_s']:.3f} "
            f"s vs {g['cold_cpu_s']:.3f} s = {g['value_cpu']:.2f}x "
            f"({'met' if g['met_cpu'] else 'NOT met'})" for k, g in goals(res).items()]


def table(res: dict) -> list[str]:
    """The result as a markdown table (medians over the draws; seconds wall, CPU in
    parentheses), one row per grid and start."""
    out = ["| grid | start | guess off | iterations | guess s | solve s | total s | vs cold | "
           "assembly + AMG setup s (all starts) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["sizes"]:
        s, grid = r["summary"], "x".join(map(str, r["grid"]))
        c = s["cold"]
        out.append(f"| {grid} | cold (zero) | - | {c['iterations']:g} | - | "
                   f"{c['solve_s']:.2f} ({c['solve_cpu_s']:.2f}) | {c['solve_s']:.2f} "
                   f"({c['solve_cpu_s']:.2f}) | 1 | {s['assemble_s'] + s['setup_s']:.1f} |")
        for start, label in (("warm", "network"), ("coarse", "coarse exact")):
            if start in s:
                w = s[start]
                out.append(f"| {grid} | {label} | {100 * w['guess_error']:.2f}% | "
                           f"{w['iterations']:g} | {w['pre_s']:.2f} ({w['pre_cpu_s']:.2f}) | "
                           f"{w['solve_s']:.2f} ({w['solve_cpu_s']:.2f}) | {w['total_s']:.2f} "
                           f"({w['total_cpu_s']:.2f}) | {w['speedup_vs_cold_s']:.2f}x "
                           f"({w['speedup_vs_cold_cpu_s']:.2f}x) | |")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.refine", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="JSON result file (default: stdout)")
    p.add_argument("--checkpoint", default=None, help="a checkpoint or run directory")
    p.add_argument("--problem", default="darcy", help="without --checkpoint: the problem")
    p.add_argument("--sizes", default="512", help="grid sizes N, comma-separated")
    p.add_argument("--work-grid", default="trained", help="where the network runs")
    p.add_argument("--coarse", default="trained",
                   help="grid of the coarse-exact control: trained, none or HxW")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--seed", type=int, default=7, help="draws no training pool used")
    p.add_argument("--tol", type=float, default=1e-8, help="relative residual")
    p.add_argument("--repeats", type=int, default=3, help="timings: the minimum of this many")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the network")
    add_set(p, "as deepfusion infer --set (the checkpoint's problem options): " + ANSWER_SET_HELP)
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    sizes = [int(s) for s in a.sizes.split(",") if s]
    res = {"command": command_line("python -m bench.refine", argv), "machine": machine(),
           "checkpoint": a.checkpoint, "tol": a.tol, "threads": a.threads,
           "repeats": a.repeats, "sizes": [run_size(a, n) for n in sizes]}
    res["machine"]["loadavg_after"] = machine()["loadavg"]
    for line in table(res) + goal_lines(res):
        print(line)
    emit_json(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
