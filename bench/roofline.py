"""The roofline of a training step: each aten op's FLOPs, bytes moved and measured time over one
step (forward, answer and loss, backward, gradient sync and optimiser), its lower bound on this
host, the step's bound, and the ops that lose most against their own bound.

    python -m bench.roofline [--grids 64:16,256:2] [--threads 1,2] [--repeats 3] [--rounds 5]
                             [--malloc-default] [--out F]

Per op, from bench/opmeter.py (every aten call's FLOPs, bytes and wall time, counted over
instrumented steps whose oneDNN primitives and allocator are already warm; an op without FLOPs,
elementwise, reductions, copies, is bound by its bytes alone):
  * bound = max(flops / compute ceiling, bytes / bandwidth at the op's footprint), with the
    ceilings of bench/host_probe.py at the step's thread count. The compute ceiling is the
    larger of torch.mm's rate and the best of the step's own convolutions run alone; the
    bandwidth is the streaming rate measured at the smallest probed footprint not below the
    op's bytes (cache-resident operands stream faster than DRAM ones), the 1 MiB rate for
    anything smaller; summed per (phase, layer, op) row, each call's bytes at its own rate.

The step's bound is the **sum** of the per-op bounds, not max(sum flops / rate, sum bytes /
bandwidth): eager PyTorch runs one op at a time, each on all threads, so one op's arithmetic
cannot hide another's memory traffic; the max of sums is the bound of a step fused into one
kernel, which also would not move the intermediates the sum counts. ``compute_floor_s`` (all
FLOPs at the compute ceiling) is reported beside it as the floor no fusion gets under.

**Rounds.** On a shared VM the host's own rate moves from one minute to the next (the 2-thread
convolution ceiling 232 then 137 GF/s in two runs back to back: lab/notes/performance.md, round
10), so a step and a ceiling timed minutes apart measure the drift as much as the step. Each
configuration is therefore also timed in ``rounds`` rounds, each a median of three steps right
beside a probe of the compute ceiling (torch.mm and the step's own convolutions, best of three,
the same threads); ``step_over_bound_rounds`` holds each round's ratio (the bound with that
round's compute ceiling) and ``step_over_bound_interleaved`` their median, which the goal reads.
The step with ``train.fused_kernels`` (the compiled kernels) is timed in the same rounds
against the same bound (``fused_step_over_bound_*``): it computes the same step, though its
Winograd convolutions multiply fewer times than the bound counts.

**Alone.** Each convolution call of the step is also run again alone (bench/alone.py): the
step's convolutions in the step against alone, and ``best_eager_over_bound``, the step with every
convolution as fast as alone and every other op at its bound, over the bound: how close to its
bound a step can come without faster convolution kernels.

Steps run as ``deepfusion train`` runs them, freed memory kept (``parallel.reuse_memory``;
``--malloc-default`` leaves glibc's settings). The step time is the median of ``repeats``
uninstrumented steps; the per-op times come from
instrumented steps (median per op over them), so they sum to a little more than the plain step
minus the time spent outside aten ops (Python, autograd's engine), which is reported as
``outside_ops_s`` = step - sum of op times (negative when the instrumented ops ran slower).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench import alone
from bench.common import build, emit_json, fused, inputs, load, wall_seconds
from bench.opmeter import measure_ops

TOP = 10


def bandwidth_at(nbytes: float, curve: list[dict]) -> float:
    """GB/s of ``curve`` (rows of footprint_mib, gbs, ascending) at the smallest probed
    footprint not below ``nbytes`` (the largest footprint's rate beyond it)."""
    for row in curve:
        if nbytes <= row["footprint_mib"] * (1 << 20):
            return row["gbs"]
    return curve[-1]["gbs"]


def op_bound(flops: float, call_bytes: dict, ceil: dict):
    """(seconds, 'compute' or 'memory'): the lower bound of a row of calls under the ceilings
    ``ceil`` (compute_gflops, bandwidth curve): its FLOPs at the compute ceiling against its
    bytes, each call's at the bandwidth of that call's footprint (``call_bytes``: {bytes of
    one call: calls})."""
    c = flops / (ceil["compute_gflops"] * 1e9)
    m = sum(n * k / (bandwidth_at(n, ceil["bandwidth"]) * 1e9) for n, k in call_bytes.items())
    return (c, "compute") if c >= m else (m, "memory")


def roofline(rows: list[dict], step_s: float, ceil: dict, top: int = TOP) -> dict:
    """The step's bound from per-op ``rows`` (flops, bytes, call_bytes, seconds) under
    ``ceil``; the ``top`` rows with the largest measured - bound, each with its share of the
    step. Pure arithmetic: no timing here."""
    out_rows = []
    for r in rows:
        bound, kind = op_bound(r["flops"], r["call_bytes"], ceil)
        r = {k: v for k, v in r.items() if k not in ("call_bytes", "replays")}
        out_rows.append({**r, "bound_s": bound, "bound_by": kind, "gap_s": r["seconds"] - bound,
                         "share_of_step": r["seconds"] / step_s,
                         "gap_share_of_step": (r["seconds"] - bound) / step_s})
    bound = sum(r["bound_s"] for r in out_rows)
    flops = sum(r["flops"] for r in out_rows)
    nbytes = sum(r["bytes"] for r in out_rows)
    ops_s = sum(r["seconds"] for r in out_rows)
    worst = sorted(out_rows, key=lambda r: r["gap_s"], reverse=True)[:top]
    return {"step_s": step_s, "bound_s": bound,
            "step_over_bound": step_s / bound if bound else None,
            "compute_floor_s": flops / (ceil["compute_gflops"] * 1e9),
            "memory_floor_dram_s": nbytes / (ceil["dram_gbs"] * 1e9),
            "flops": flops, "bytes": nbytes, "ops_s": ops_s, "outside_ops_s": step_s - ops_s,
            "compute_gflops": ceil["compute_gflops"], "compute_source": ceil["compute_source"],
            "ops": len(out_rows), "top_ops": worst,
            "by_phase": _by(out_rows, "phase", step_s),
            "by_op": dict(sorted(_by(out_rows, "op", step_s).items(),
                                 key=lambda kv: kv[1]["bound_s"] - kv[1]["seconds"])[:top])}


def _by(rows, field, step_s) -> dict:
    out = {}
    for r in rows:
        d = out.setdefault(r[field], {"seconds": 0.0, "bound_s": 0.0, "flops": 0.0, "bytes": 0.0})
        for k in ("seconds", "bound_s", "flops", "bytes"):
            d[k] += r[k]
    for d in out.values():
        d["share_of_step"] = d["seconds"] / step_s
    return out


def conv_shapes(rows: list[dict]) -> list[dict]:
    """The distinct forward 2-D convolutions of the measured rows (input and weight shapes,
    stride, padding, groups), for the host probe."""
    seen = {}
    for r in rows:
        c = r.get("conv")
        if c and r["phase"] == "forward" and len(r["shapes"][1]) == 4 and not c["transposed"]:
            s = {"x": r["shapes"][0], "w": r["shapes"][1], "stride": c["stride"],
                 "padding": c["padding"], "groups": c["groups"]}
            seen[str(s)] = s
    return list(seen.values())


def measure_config(grid, batch, threads, repeats=3, problem="burgers", generator="unet"):
    """One configuration's step time (median of ``repeats``) and per-op rows, as trained
    (deepfusion's step, channels_last)."""
    import torch

    from bench.step_bench import make_deepfusion

    torch.set_num_threads(threads)
    prob, model = build(problem, grid, generator, channels_last=True)
    step = make_deepfusion(prob, model, inputs(prob, batch))
    step(), step()  # warm: oneDNN primitives, allocator
    times = wall_seconds(step, repeats)
    rows = measure_ops(step, steps=repeats, network=type(model).__name__)
    # train.fused_kernels: the same network and step with the compiled kernels, timed
    # against the same bound (its rows would hide the kernels' work from the op count)
    kernel = fused(build(problem, grid, generator, channels_last=True)[1])
    fused_step = None if kernel is None else make_deepfusion(prob, kernel, inputs(prob, batch))
    if fused_step is not None:
        fused_step(), fused_step()
    return {"grid": grid, "batch": batch, "threads": threads, "step_s": statistics.median(times),
            "step_s_all": times, "rows": rows, "step": step, "fused_step": fused_step}


def interleaved(c: dict, ceil: dict, shapes: list,
                rounds: int) -> tuple[list[float], list[float]]:
    """Step / bound of configuration ``c`` in each of ``rounds`` rounds: a median of three steps,
    then the compute ceiling probed at once on the same threads (module docstring, Rounds); and
    the same of its fused step (``train.fused_kernels``; empty where it cannot be built)."""
    import torch

    from bench import host_probe

    ratios, fused_ratios = [], []
    for _ in range(rounds):
        torch.set_num_threads(c["threads"])
        step_s = statistics.median(wall_seconds(c["step"], 3))
        fused_s = c["fused_step"] and statistics.median(wall_seconds(c["fused_step"], 3))
        compute = host_probe.compute_ceiling(c["threads"], shapes, repeats=3)["compute_gflops"]
        for s, out in ((step_s, ratios), (fused_s, fused_ratios)):
            if s:
                out.append(roofline(c["rows"], s, {**ceil, "compute_gflops": compute})
                           ["step_over_bound"])
    return ratios, fused_ratios


def run(grids=((64, 16), (256, 2)), threads=(1, 2), repeats=3, log=print,
        footprints_mib=None, rounds=5, reuse_memory=True) -> dict:
    """Measure every configuration, then probe the ceilings once per thread count (with the
    union of the configurations' convolutions), then bound each, and time each in ``rounds``
    rounds beside its compute ceiling (module docstring). ``footprints_mib``: the bandwidth
    probe's footprints (default host_probe's, up to 1 GiB). ``reuse_memory``: freed memory kept
    in the process, as ``deepfusion train`` runs without a domain split
    (``parallel.reuse_memory``); the setting stays for the rest of the process."""
    from bench import host_probe
    from deepfusion.engine.parallel.memory import reuse_freed_memory

    reuse_freed_memory(reuse_memory)

    footprints_mib = footprints_mib or host_probe.FOOTPRINTS_MIB
    load0, t0 = load(), time.perf_counter()
    configs = [measure_config(g, b, t, repeats) for t in threads for g, b in grids]
    ceilings, shapes = {}, {}
    for t in threads:
        shapes[t] = list({str(s): s for c in configs if c["threads"] == t
                          for s in conv_shapes(c["rows"])}.values())
        ceilings[t] = host_probe.ceilings(t, shapes[t], footprints_mib=footprints_mib)
    out = {"isa": host_probe.isa(), "loadavg_before": load0, "ceilings": list(ceilings.values()),
           "reuse_memory": reuse_memory, "runs": []}
    for c in configs:
        ratios, fused_ratios = interleaved(c, ceilings[c["threads"]], shapes[c["threads"]],
                                           rounds)
        r = {"grid": c["grid"], "batch": c["batch"], "threads": c["threads"],
             "step_s_all": c["step_s_all"],
             **roofline(c["rows"], c["step_s"], ceilings[c["threads"]]),
             "step_over_bound_rounds": ratios,
             "step_over_bound_interleaved": statistics.median(ratios) if ratios else None,
             "fused_step_over_bound_rounds": fused_ratios,
             "fused_step_over_bound_interleaved":
                 statistics.median(fused_ratios) if fused_ratios else None}
        ceil = ceilings[c["threads"]]
        r["alone"] = alone.conv_alone(
            c["rows"], lambda o: op_bound(o["flops"], o["call_bytes"], ceil)[0])
        r["best_eager_over_bound"] = r["alone"]["best_eager_s"] / r["bound_s"]
        out["runs"].append(r)
        log(f"  roofline {c['grid']}^2 b{c['batch']} t{c['threads']}: step "
            f"{r['step_s'] * 1e3:.0f} ms, bound {r['bound_s'] * 1e3:.0f} ms "
            f"(x{r['step_over_bound']:.2f}; in rounds {_ratios(ratios)}; fused kernels "
            f"{_ratios(fused_ratios)}); {_alone(r)}; "
            f"load {load()[0]}")
    out["loadavg_after"], out["seconds"] = load(), time.perf_counter() - t0
    return out


def _alone(r: dict) -> str:
    a = r["alone"]
    return (f"convolutions {a['conv_in_step_s'] * 1e3:.0f} ms in the step, "
            f"{a['conv_alone_s'] * 1e3:.0f} ms alone; with them as alone and the rest at its "
            f"bound the step would be x{r['best_eager_over_bound']:.2f} its bound")


def _ratios(ratios) -> str:
    return ", ".join(f"{x:.2f}" for x in ratios) or "none"


def lines(res: dict) -> list[str]:
    """The printed table: ceilings, step / bound per configuration, its top ops."""
    isa = res["isa"]
    out = [f"roofline ceilings ({isa['cpu_capability']}, avx512_bf16 {isa['avx512_bf16']}, "
           f"amx_bf16 {isa['amx_bf16']}; fp32):"]
    for c in res["ceilings"]:
        out.append(f"  t{c['threads']}: GEMM {c['gemm_gflops']:.0f} GF/s, best own conv "
                   f"{c['conv_best_gflops'] or 0:.0f} GF/s -> compute {c['compute_gflops']:.0f} "
                   f"GF/s ({c['compute_source']}); bandwidth " +
                   ", ".join(f"{b['footprint_mib']}M {b['gbs']:.0f}" for b in c["bandwidth"]) +
                   " GB/s")
    for r in res["runs"]:
        out.append(f"roofline {r['grid']}^2 b{r['batch']} t{r['threads']}: step "
                   f"{r['step_s'] * 1e3:.0f} ms, bound {r['bound_s'] * 1e3:.0f} ms, step/bound "
                   f"{r['step_over_bound']:.2f} (compute floor {r['compute_floor_s'] * 1e3:.0f} "
                   f"ms, outside ops {r['outside_ops_s'] * 1e3:.0f} ms); in rounds beside the "
                   f"compute ceiling {_ratios(r.get('step_over_bound_rounds', []))}; with "
                   f"train.fused_kernels {_ratios(r.get('fused_step_over_bound_rounds', []))}")
        if "alone" in r:
            out.append(f"  {_alone(r)}")
        out.append(f"  {'phase':<9} {'layer':<22} {'op':<26} {'calls':>5} {'ms':>7} "
                   f"{'bound':>7} {'by':<7} {'gap':>7} {'%step':>6}")
        out.append("  by op over all layers (ms/bound ms): " + ", ".join(
            f"{k} {v['seconds'] * 1e3:.0f}/{v['bound_s'] * 1e3:.0f}"
            for k, v in list(r.get("by_op", {}).items())[:5]))
        for o in r["top_ops"]:
            out.append(f"  {o['phase']:<9} {o['layer'][-22:]:<22} {o['op'][:26]:<26} "
                       f"{o['calls']:>5} {o['seconds'] * 1e3:>7.1f} {o['bound_s'] * 1e3:>7.1f} "
                       f"{o['bound_by']:<7} {o['gap_s'] * 1e3:>7.1f} {o['share_of_step']:>6.1%}")
    return out


def main(argv=None) -> int:
    from bench.step_bench import parse_grids, parse_threads

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grids", default="64:16,256:2", help="GRID:BATCH,...")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds of steps timed beside the compute ceiling (module docstring)")
    p.add_argument("--malloc-default", action="store_true",
                   help="leave glibc's malloc settings (default: freed memory kept, as trained)")
    p.add_argument("--out")
    a = p.parse_args(argv)
    res = run(parse_grids(a.grids), parse_threads(a.threads), a.repeats, rounds=a.rounds,
              reuse_memory=not a.malloc_default)
    print("\n".join(lines(res)))
    emit_json(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
