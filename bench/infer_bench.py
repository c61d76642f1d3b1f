"""Inference vs the reference solver, per sample, on one machine, in one run.

    python -m bench.infer_bench --out bench/out/infer.json [--sizes 256,512,1024]
                                [--checkpoint CKPT [--work-grid trained]] [--batches 1,2,4,8]
                                [--samples 8] [--precision fp32|bf16]
                                [--problem poisson] [--solvers direct,amg]
                                [--set problem.options.KEY=VALUE ...]

For each grid size N (N x N, or N x N x N for a 3-D problem such as ``poisson3d``) and each
configuration -- network inference at every batch size and each reference solver of
``--solvers`` (the problem's ``reference_solution``: for the elliptic problems "direct" is
SuperLU, "amg" pyamg smoothed aggregation + CG) -- a fresh subprocess measures the seconds per
sample (after an untimed warm-up: the network on the same shape, the solver on a 16-node grid
of the same problem, which loads the same code without a second large solve) and its peak RSS
(VmHWM, also given as the increase over the RSS right after setup), so configurations
do not inherit each other's memory. Every worker keeps freed memory for reuse, as ``deepfusion
infer`` and ``solve`` do (``deepfusion.engine.parallel.memory``), so the timed pass after the warm-up
does not fault its pages in again. The first solver of ``--solvers`` is the reference the
errors are measured against (use ``--solvers amg`` in 3-D above 32^3: a sparse direct
factorisation of a 3-D grid fills in far beyond the machine's memory).

The network: the checkpoint's generator (``--checkpoint``, rebuilt at each grid size, the
problem taken from the checkpoint; the relative L2 error of its predictions against the
reference solutions is reported), else the problem's default U-Net (``unet``, ``unet3d`` in
3-D) with random weights (timing only: the error is null, marked "untrained").
The network runs exactly as ``deepfusion infer`` runs it (the prediction service,
``deepfusion.engine.predict.service``: its pipeline, ``Predictor`` and loop; ``--work-grid``
resolution transfer, resampling inside the time).

The solvers solve on one core while the network uses ``--threads``. With ``--threads`` T > 1
each solver is also run as T one-thread processes at once on the same draws
(``solver_<method>_node``: the seconds per solve, and per answer on the node = that / T), and
``speedup_vs_<method>_node`` sets the network against that: the like-for-like figure for a node
answering many draws. ``speedup_vs_<method>`` (one solve at a time) flatters the network.

Controls (with ``--work-grid``): the reference solver on the work grid, interpolated to the
N grid the same way, timed and compared with the N-grid reference solution -- it says how much of the speed-up
comes from the problem being resolved on the coarse grid rather than from the network; and the
same network run on the N grid itself (batch 1, its time and error).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from bench.common import ROOT, emit_json, peak_rss_mb
from deepfusion.app.options import ANSWER_SET_HELP, add_set, problem_options


# ---------------------------------------------------------------------------------------------
# worker (one configuration per process)
# ---------------------------------------------------------------------------------------------

def _grid(cfg) -> tuple:
    from diffnet.problems import PROBLEMS

    return (cfg["size"],) * PROBLEMS[cfg["problem"]].dims


def _setup(cfg):
    import numpy as np
    import torch

    torch.set_num_threads(cfg["threads"])
    work = None
    if cfg.get("checkpoint"):
        from deepfusion.engine.predict.loader import load

        loaded = load(cfg["checkpoint"], grid=_grid(cfg), work_grid=cfg.get("work_grid"),
                      options=cfg.get("options"))
        model, problem, work = loaded.model, loaded.problem, loaded.work
    else:
        from diffnet.generators import build_generator
        from diffnet.problems import get_problem

        torch.manual_seed(0)
        problem = get_problem(cfg["problem"], grid=_grid(cfg))
        name = "unet3d" if problem.dims == 3 else "unet"
        model = build_generator(name, in_channels=len(problem.input_channels)).eval()
    if cfg.get("precision") == "bf16":
        model = model.to(torch.bfloat16)
    params = problem.sample_params(cfg["seed"], np.arange(cfg["n"]))
    return model, problem, work, params


def _infer(cfg, model, problem, work, params):
    import numpy as np

    from deepfusion.engine.predict import service
    from deepfusion.engine.predict.pipeline import Samples

    samples = Samples(params)
    pipe = service.pipeline(model, problem, work=work, channels_last=True)
    # as infer computes a batch: each new shape warmed up untimed, the answers as float32 arrays
    compute = service.Predictor(pipe, samples, warmup=True,
                                finish=service.as_arrays(problem, samples))
    done = service.Collector()
    total = service.run(compute, service.contiguous_batches(len(params), cfg["batch"]), done)
    return total, np.concatenate([b.u.astype(np.float64) for b in done.batches])


def _warm_solver(problem, params, method: str) -> None:
    """An untimed solve on a 16-node grid of the same problem: imports and first-call costs."""
    from diffnet.problems import get_problem

    small = get_problem(problem.name, **{**problem.config(), "grid": (16,) * problem.dims})
    small.reference_solution(params[0], method)


def _coarse(cfg, problem, work, params):
    """Control: the reference solve on the work grid, interpolated to the full grid (timed)."""
    import numpy as np
    import torch

    from diffnet.resample import resample_nodes

    total, out = 0.0, []
    _warm_solver(work, params, cfg["method"])
    for p in params:
        t0 = time.perf_counter()
        u = work.reference_solution(p, cfg["method"])
        u = resample_nodes(torch.from_numpy(u)[None, None], problem.grid)[0, 0].numpy()
        total += time.perf_counter() - t0
        out.append(u)
    return total, np.stack(out)


def _solve(cfg, problem, params):
    import numpy as np

    total, refs = 0.0, []
    _warm_solver(problem, params, cfg["method"])
    for p in params:
        t0 = time.perf_counter()
        refs.append(problem.reference_solution(p, cfg["method"]))
        total += time.perf_counter() - t0
    return total, np.stack(refs)


def worker(cfg: dict) -> dict:
    """Measure one configuration; print and return its JSON record."""
    import numpy as np

    from deepfusion.engine.parallel.memory import reuse_freed_memory

    reuse_freed_memory(True)   # both sides, as deepfusion infer and solve run
    model, problem, work, params = _setup(cfg)
    rss0 = peak_rss_mb()
    if cfg["kind"] == "infer":
        total, fields = _infer(cfg, model, problem, work, params)
    elif cfg["kind"] == "coarse":
        total, fields = _coarse(cfg, problem, work, params)
    else:
        total, fields = _solve(cfg, problem, params)
    if cfg.get("save"):
        np.save(cfg["save"], fields)
    rec = {**{k: cfg[k] for k in ("kind", "size", "n", "batch", "method") if k in cfg},
           "seconds_per_sample": total / len(params), "peak_rss_mb": peak_rss_mb(),
           "rss_after_setup_mb": rss0}
    rec["peak_rss_increase_mb"] = rec["peak_rss_mb"] - rss0
    print(json.dumps(rec), flush=True)
    return rec


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------

def _start(cfg: dict) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS=str(cfg["threads"]),
               DEEPFUSION_NO_MPI="1")
    return subprocess.Popen([sys.executable, "-m", "bench.infer_bench", "--worker",
                             json.dumps(cfg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=ROOT)


def _finish(cfg: dict, proc: subprocess.Popen, quiet: bool = False) -> dict:
    out, err = proc.communicate()
    if proc.returncode != 0:
        err = err.strip().splitlines()[-1:] or ["failed"]
        print(f"  {cfg['kind']:5s} {cfg['size']:5d}  batch={cfg.get('batch', '-')!s:3s} "
              f"failed: {err[0]}", flush=True)
        return {**cfg, "error": err}
    rec = json.loads(out.strip().splitlines()[-1])
    if not quiet:
        print(f"  {rec['kind']:5s} {cfg['size']:5d}  batch={cfg.get('batch', '-')!s:3s} "
              f"method={cfg.get('method', '-'):6s} {rec['seconds_per_sample']:.4g} s/sample  "
              f"peak RSS {rec['peak_rss_mb']:.0f} MB", flush=True)
    return rec


def _run(cfg: dict) -> dict:
    return _finish(cfg, _start(cfg))


def _run_node(cfg: dict, copies: int) -> dict:
    """``copies`` one-thread solver processes at once on the same draws (so they run in step):
    the node's time per answer when it solves many draws, one per core. The solvers (SuperLU,
    pyamg) solve on one core, so timing one solve alone sets them against a network that used
    every core for its answer."""
    cfg = {**cfg, "threads": 1}
    recs = [_finish(cfg, p, quiet=True) for p in [_start(cfg) for _ in range(copies)]]
    if any("error" in r for r in recs):
        return {**cfg, "error": next(r["error"] for r in recs if "error" in r)}
    each = sorted(r["seconds_per_sample"] for r in recs)[len(recs) // 2]
    rec = {"copies": copies, "threads_each": 1, "seconds_per_solve": each,
           "seconds_per_sample": each / copies,
           "peak_rss_mb": sum(r["peak_rss_mb"] for r in recs)}
    print(f"  solve {cfg['size']:5d}  method={cfg['method']:6s} {copies} at once, 1 thread each: "
          f"{each:.4g} s per solve = {rec['seconds_per_sample']:.4g} s/sample on the node  "
          f"peak RSS {rec['peak_rss_mb']:.0f} MB in all", flush=True)
    return rec


def bench_size(size: int, args, tmp: str) -> dict:
    import numpy as np

    from diffnet.metrics import relative_l2

    base = {"size": size, "seed": 777, "threads": args.threads, "checkpoint": args.checkpoint,
            "work_grid": args.work_grid, "precision": args.precision, "problem": args.problem,
            "options": args.options}
    n_solve = args.solver_samples or (2 if size >= 1024 else 4)
    ref = args.solvers[0]  # the errors are measured against the first solver
    ref_path = os.path.join(tmp, f"ref{size}.npy")
    solvers = {m: _run({**base, "kind": "solve", "method": m, "n": n_solve,
                        **({"save": ref_path} if m == ref else {})}) for m in args.solvers}
    ref_ok = "error" not in solvers[ref]
    node = {m: _run_node({**base, "kind": "solve", "method": m, "n": n_solve}, args.threads)
            for m in args.solvers} if args.threads > 1 else {}
    infers = []
    for b in args.batches:
        n = max(args.samples, b)
        pred_path = os.path.join(tmp, f"pred{size}_{b}.npy")
        rec = _run({**base, "kind": "infer", "batch": b, "n": n, "save": pred_path})
        rec["_pred"] = pred_path
        infers.append(rec)
    ok = [r for r in infers if "error" not in r]
    best = min(ok, key=lambda r: r["seconds_per_sample"]) if ok else None
    rel = None
    if args.checkpoint and best and ref_ok:
        refs, pred = np.load(ref_path), np.load(best["_pred"])
        m = min(len(refs), len(pred))  # same seed: sample j is the same in both
        err = relative_l2(pred[:m], refs[:m])
        rel = {"mean": float(np.mean(err)), "median": float(np.median(err)),
               "worst": float(np.max(err)), "n": m}
    for r in infers:
        r.pop("_pred", None)

    def control(name: str, **cfg) -> dict:
        """Run a control on the solver's samples; add its error against the reference."""
        path = os.path.join(tmp, f"{name}{size}.npy")
        rec = _run({**base, "n": n_solve, "save": path, **cfg})
        if "error" not in rec and ref_ok:
            rec[f"rel_l2_mean_vs_{ref}"] = float(np.mean(relative_l2(np.load(path),
                                                                     np.load(ref_path))))
        return rec

    coarse = full = None
    if args.checkpoint and str(args.work_grid or "none").lower() != "none":
        # the same network run on the N grid itself (no work grid): time and error
        full = control("full", kind="infer", batch=1, work_grid="none")
        coarse = control("coarse", kind="coarse", method=ref)
    batch1 = next((r for r in ok if r["batch"] == 1), None)
    out = {"size": size, "grid": [size] * len(_dims_of(args)), "reference": ref,
           **{f"solver_{m}": r for m, r in solvers.items()}, "inference": infers,
           "inference_batch1_s": batch1 and batch1["seconds_per_sample"],
           "inference_best": best and {"batch": best["batch"], "s": best["seconds_per_sample"]},
           **{f"speedup_vs_{m}": _ratio(r, best) for m, r in solvers.items()},
           **{f"solver_{m}_node": r for m, r in node.items()},
           **{f"speedup_vs_{m}_node": _ratio(r, best) for m, r in node.items()},
           f"rel_l2_mean_vs_{ref}": rel and rel["mean"], "rel_l2_vs_reference": rel,
           f"control_{ref}_on_work_grid": coarse, "network_on_full_grid_batch1": full,
           "error_note": None if args.checkpoint else "untrained network: error not reported"}
    return out


def _dims_of(args) -> range:
    from diffnet.problems import PROBLEMS

    return range(PROBLEMS[args.problem].dims)


def _ratio(solver: dict, best: dict | None):
    if best is None or "error" in solver:
        return None
    return solver["seconds_per_sample"] / best["seconds_per_sample"]


def _checkpoint_problem(path: str) -> str:
    from deepfusion.engine.checkpoint.store import load_checkpoint

    return load_checkpoint(path)["meta"]["problem"]["name"]


def _check_solvers(name: str, solvers: list) -> None:
    from diffnet.problems import PROBLEMS

    valid = PROBLEMS[name].reference_methods
    bad = [m for m in solvers if m not in valid]
    if bad or not solvers:
        raise SystemExit(f"--solvers {','.join(solvers)}: problem {name!r} has the reference "
                         f"methods {list(valid)}; give one or more of them, comma-separated")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/out/infer.json")
    p.add_argument("--sizes", default="256,512")
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--samples", type=int, default=8, help="inference samples per config")
    p.add_argument("--solver-samples", type=int, default=0,
                   help="solver samples per config (default 4; 2 at N >= 1024)")
    p.add_argument("--checkpoint", help="trained checkpoint (else untrained default unet)")
    p.add_argument("--work-grid", help="as deepfusion infer --work-grid (HxW, trained, none); "
                                       "adds the coarse reference-solve control")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--problem", default="poisson",
                   help="problem without --checkpoint (with one: the checkpoint's problem)")
    p.add_argument("--solvers", default="direct,amg",
                   help="reference methods to time; the first is the error reference")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    add_set(p, "as deepfusion infer --set (with --checkpoint): " + ANSWER_SET_HELP)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.batches = [int(b) for b in args.batches.split(",")]
    args.solvers = [m for m in args.solvers.split(",") if m]
    try:
        args.options = problem_options(args, "bench.infer_bench")
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if args.checkpoint:
        args.checkpoint = os.path.abspath(args.checkpoint)
        args.problem = _checkpoint_problem(args.checkpoint)
    _check_solvers(args.problem, args.solvers)
    out = {"machine": {"host": platform.node(), "cpu_count": os.cpu_count(),
                       "threads": args.threads, "python": platform.python_version(),
                       "loadavg_start": os.getloadavg()},
           "checkpoint": args.checkpoint, "work_grid": args.work_grid, "problem": args.problem,
           "precision": args.precision, "options": args.options, "results": []}
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            print("size " + "x".join([str(size)] * len(_dims_of(args))), flush=True)
            out["results"].append(bench_size(size, args, tmp))
    out["machine"]["loadavg_end"] = os.getloadavg()  # other jobs on the host skew timings
    emit_json(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
