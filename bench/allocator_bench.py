"""DeepFusion's training step as ``deepfusion train`` runs it against the plain PyTorch loop as a
user runs it: each in its own process, with its own C allocator setting.

    python -m bench.allocator_bench [--grids 64:16,256:2] [--threads 1,2] [--repeats 3]
                                    [--steps 5] [--out FILE.json]

``step_bench`` times every configuration in one process, so they all share one allocator
(glibc's defaults). ``deepfusion train`` keeps freed memory for reuse
(``parallel.reuse_memory``, ``deepfusion/engine/parallel/memory.py``); a plain loop gets glibc's default,
which hands large blocks out as fresh mmaps and so faults a step's activations in again every
step (the page faults per step are reported). A process's allocator can
be set once, so each configuration runs in its own worker process: ``plain`` (default malloc),
``deepfusion`` (reuse, as trained), ``deepfusion_fused`` (the same with
``train.fused_kernels``, where GCC can build the kernel), with ``--bf16`` also
``deepfusion_bf16`` (``train.precision = "bf16"``, reuse), and, to separate the two effects,
``plain_reuse``. Workers
take turns (``--repeats`` rounds), each warms up 2 steps and reports the median of ``--steps``
steps and its page faults per step; the result per configuration is the median over rounds.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from bench.common import emit_json, load, median, run_json

# name -> (step maker, keep freed memory, train.precision of the deepfusion step)
CONFIGS = {"plain": ("plain", False, None), "plain_reuse": ("plain", True, None),
           "deepfusion": ("deepfusion", True, "fp32"),
           "deepfusion_fused": ("deepfusion_fused", True, "fp32"),  # train.fused_kernels
           "deepfusion_bf16": ("deepfusion", True, "bf16")}


def worker(a) -> int:
    import torch

    torch.set_num_threads(a.threads)
    from deepfusion.engine.parallel.memory import reuse_freed_memory

    kind, reuse, precision = CONFIGS[a.config]
    reuse_freed_memory(reuse)
    from bench.common import build, fused, inputs
    from bench.step_bench import make_deepfusion, make_plain, stock_norms

    task, model = build("burgers", a.grid, "unet", channels_last=False)
    x = inputs(task, a.batch)
    if kind == "deepfusion_fused" and fused(model.to(memory_format=torch.channels_last)) is None:
        print(json.dumps({"skipped": "the fused kernel cannot be built here"}), flush=True)
        return 0
    if kind == "plain":
        step = make_plain(task, stock_norms(model), x)
    else:
        step = make_deepfusion(task, model.to(memory_format=torch.channels_last), x,
                               precision=precision)
    for _ in range(2):
        step()
    times = []
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(a.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0) / a.steps
    print(json.dumps({"step_s": median(times), "faults_per_step": faults}), flush=True)
    return 0


def bench_grid(grid, batch, threads, repeats, steps, bf16=False, log=print) -> dict:
    rounds = {k: [] for k, (_, _, precision) in CONFIGS.items() if bf16 or precision != "bf16"}
    for _ in range(repeats):
        for k in rounds:
            r = run_json([sys.executable, "-m", "bench.allocator_bench", "--worker", "--config", k,
                          "--grid", str(grid), "--batch", str(batch), "--threads", str(threads),
                          "--steps", str(steps)])
            if "error" in r:
                raise RuntimeError(f"allocator bench worker {k} {grid}^2 failed: {r['error'][-300:]}")
            rounds[k].append(r)
    rounds = {k: v for k, v in rounds.items() if not any("skipped" in r for r in v)}
    out = {"grid": grid, "batch": batch, "threads": threads, "repeats": repeats, "steps": steps,
           "configs": {k: {"step_s": median([r["step_s"] for r in v]),
                           "faults_per_step": median([r["faults_per_step"] for r in v]),
                           "step_s_rounds": [r["step_s"] for r in v]}
                       for k, v in rounds.items()}}
    plain = out["configs"]["plain"]["step_s"]
    for v in out["configs"].values():
        v["speedup_vs_plain"] = plain / v["step_s"]
    log(f"  as run {grid}^2 b{batch} t{threads}: " + ", ".join(
        f"{k} {v['step_s'] * 1e3:.0f} ms ({v['faults_per_step']:.0f} faults/step)"
        for k, v in out["configs"].items()) + f"; load {load()[0]}")
    return out


def run(grids=((64, 16), (256, 2)), threads=(1, 2), repeats=3, steps=5, bf16=False,
        log=print) -> dict:
    return {"runs": [bench_grid(g, b, t, repeats, steps, bf16, log)
                     for t in threads for g, b in grids]}


def main(argv=None) -> int:
    from bench.step_bench import parse_grids, parse_threads

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", choices=sorted(CONFIGS), default="deepfusion")
    p.add_argument("--grid", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--grids", default="64:16,256:2", help="GRID:GLOBAL_BATCH,...")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--bf16", action="store_true", help="also time train.precision = bf16")
    p.add_argument("--out")
    a = p.parse_args(argv)
    if a.worker:
        a.threads = int(a.threads)
        return worker(a)
    res = run(parse_grids(a.grids), parse_threads(a.threads), a.repeats,
              a.steps, a.bf16)
    emit_json(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
