"""Peak memory (RSS high-water mark) of one training step per rank, with and without activation
checkpointing (model option checkpoint_levels = true), and of inference on large grids.

    python -m bench.memory_bench [--sizes 256,512,1024] [--batch 1] [--threads 2]
                                 [--infer-sizes 1024,2048]
                                 [--problem burgers --model unet --model-options '{...}']

Each (grid, checkpointing) configuration, and each grid with ``train.fused_kernels`` (where GCC
can build the kernel), runs in its own subprocess, so high-water marks do not mix: the worker
builds the generator (default: the default ``unet``) and the problem (default: Burgers) at N x N (N x N x N for a 3-D problem such as ``poisson3d``, with e.g.
``--model unet3d``), records its RSS after setup, runs one DeepFusion training step (forward,
backward, Adam) and reports VmHWM from /proc/self/status, the increase over the set-up RSS,
and the step times. Freed memory is kept for reuse, as ``deepfusion train`` does by default
(``parallel.reuse_memory``; ``--malloc-default`` for glibc's defaults). The first step of a
process pays one-off costs (oneDNN primitive creation, first-touch page faults), and the next
few still pay some (at 1024² the fused step took 5.45, 4.76, 4.37, 4.14 s in one process: the
kept memory growing to the step's set of sizes), so the default ``--steps 6`` times more:
``step_s_steady``, the median of the second half of the steps, the step a run repeats
thousands of times, is what the 1024^2 goal of ``make bench`` reads; ``step_s`` is the first.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from bench.common import emit_json, load, peak_rss_mb, rss_mb, run_json

STEPS = 6  # training steps timed per configuration; the steady step is the second half's median


def worker(a) -> int:
    import torch

    torch.set_num_threads(a.threads)
    from bench.common import build, fused, inputs
    from bench.step_bench import make_deepfusion
    from deepfusion.engine.parallel.memory import reuse_freed_memory

    reuse_freed_memory(not a.malloc_default)

    opts = {**json.loads(a.model_options), "checkpoint_levels": bool(a.checkpoint)}
    task, model = build(a.problem, a.size, a.model, opts)
    if a.fused and fused(model) is None:
        print(json.dumps({"skipped": "the fused kernel cannot be built here"}), flush=True)
        return 0
    x = inputs(task, a.batch)
    step = make_deepfusion(task, model, x)
    base = rss_mb()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = peak_rss_mb()
    print(json.dumps({"size": a.size, "grid": list(task.grid), "problem": a.problem,
                      "model": a.model, "batch": a.batch, "checkpoint_levels": bool(a.checkpoint),
                      "fused_kernels": bool(a.fused),
                      "threads": a.threads, "setup_rss_mb": base, "peak_rss_mb": peak,
                      "step_increase_mb": peak - base, "step_s": times[0], "step_s_all": times,
                      "step_s_steady": (statistics.median(times[len(times) // 2:])
                                        if len(times) > 1 else None),
                      "reuse_memory": not a.malloc_default, "loadavg": load()}), flush=True)
    return 0


def infer_worker(a) -> int:
    import torch

    torch.set_num_threads(a.threads)
    from bench.common import build, inputs

    task, model = build("poisson", a.size, "unet", {})
    model.eval()
    x = inputs(task, 1).contiguous(memory_format=torch.channels_last)
    base = rss_mb()
    with torch.inference_mode():
        t0 = time.perf_counter()
        u = task.answer(model(x), x)
        dt = time.perf_counter() - t0
    assert u.shape[-2:] == x.shape[-2:]
    peak = peak_rss_mb()
    print(json.dumps({"size": a.size, "batch": 1, "threads": a.threads, "setup_rss_mb": base,
                      "peak_rss_mb": peak, "infer_increase_mb": peak - base, "forward_s": dt,
                      "field_mb": 4 * a.size * a.size / 2**20, "loadavg": load()}), flush=True)
    return 0


def step_times(r: dict) -> str:
    """'step 12.6 s' or 'first step 12.6 s, then 7.1 s' (the median of the second half of the
    steps) for a memory row."""
    if r.get("step_s_steady") is None:
        return f"step {r['step_s']:.1f} s"
    return f"first step {r['step_s']:.1f} s, then {r['step_s_steady']:.1f} s"


def _dims(problem: str) -> int:
    from diffnet.problems import PROBLEMS

    return PROBLEMS[problem].dims


def run_infer(sizes=(1024, 2048), threads=2, log=print) -> list:
    rows = []
    for n in sizes:
        r = run_json([sys.executable, "-m", "bench.memory_bench", "--worker", "--infer",
                      "--size", str(n), "--threads", str(threads)])
        rows.append(r if "error" not in r else {"size": n, **r})
        if "error" in r:
            log(f"  inference memory {n}^2: failed: {r['error'][-300:]}")
        else:
            log(f"  inference {n}^2 b1: peak {r['peak_rss_mb']:.0f} MiB "
                f"(+{r['infer_increase_mb']:.0f} over setup), forward {r['forward_s']:.1f} s")
    return rows


def run(sizes=(256, 512, 1024), batch=1, threads=2, log=print, infer_sizes=(),
        model=("burgers", "unet", "{}"), steps=STEPS) -> dict:
    """``model`` is (problem, generator, generator options as JSON)."""
    rows = []
    which = ["--problem", model[0], "--model", model[1], "--model-options", model[2]]
    dims = _dims(model[0])
    for n in sizes:
        for ck, fuse in ((0, 0), (1, 0), (0, 1)):  # the last: train.fused_kernels
            r = run_json([sys.executable, "-m", "bench.memory_bench", "--worker", "--size", str(n),
                          "--batch", str(batch), "--threads", str(threads), "--checkpoint", str(ck),
                          "--steps", str(steps), "--fused", str(fuse), *which])
            if "skipped" in r:  # no GCC: the fused rows are left out (the worker said why)
                continue
            rows.append(r if "error" not in r else
                        {"size": n, "checkpoint_levels": bool(ck), "fused_kernels": bool(fuse), **r})
            what = f"{n}^{dims} b{batch} ckpt={bool(ck)}{' fused' if fuse else ''}"
            if "error" in r:
                log(f"  memory {what}: failed: {r['error'][-300:]}")
            else:
                log(f"  memory {what}: peak {r['peak_rss_mb']:.0f} MiB "
                    f"(+{r['step_increase_mb']:.0f} over setup), {step_times(r)}")
    return {"batch": batch, "threads": threads, "problem": model[0], "model": model[1],
            "model_options": json.loads(model[2]), "rows": rows,
            "inference": run_infer(infer_sizes, threads, log)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--checkpoint", type=int, default=0)
    p.add_argument("--fused", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--infer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--infer-sizes", default="1024,2048")
    p.add_argument("--sizes", default="256,512,1024")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=STEPS,
                   help="training steps timed per configuration (the median of the second half "
                        "is the steady step)")
    p.add_argument("--malloc-default", action="store_true",
                   help="glibc's default malloc instead of parallel.reuse_memory's")
    p.add_argument("--problem", default="burgers")
    p.add_argument("--model", default="unet")
    p.add_argument("--model-options", default="{}", help="generator options as JSON")
    p.add_argument("--out")
    a = p.parse_args(argv)
    if a.worker:
        return infer_worker(a) if a.infer else worker(a)
    res = run(tuple(int(s) for s in a.sizes.split(",")), a.batch, a.threads,
              infer_sizes=tuple(int(s) for s in a.infer_sizes.split(",") if s),
              model=(a.problem, a.model, a.model_options), steps=a.steps)
    emit_json(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
