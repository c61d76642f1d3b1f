"""Domain parallelism (``parallel.domain``): memory per rank, strong scaling of one large sample,
and the biggest field that trains, with real mpiexec jobs.

    python -m bench.domain_bench [--size 2048] [--big 4096] [--steps 3] [--out FILE] [--quick]
                                 [--parts p1,p2,p4,big] [--profile]

(``python -m bench.run --with-domain`` runs it too; not in the default ``make bench``: the full
run takes ~10 minutes on the 2-core machine.)

Configurations (each its own ``mpiexec -n P python -m bench.domain_bench --worker ...`` job, so
high-water marks do not mix; every rank reports, the driver takes the max over ranks). All run
the engine's path: the default generator ("unet", default options) and the Burgers problem
(default options), fp32, channels_last; ``parallelize`` with the domain split, the problem's
``on_block``, the inputs built on the whole grid and cut with ``block.local``,
:class:`~deepfusion.engine.step.LossAndGrad` and Adam. Batch 1, one thread per rank.

  p1       SIZE^2 undivided on 1 rank: setup RSS, peak RSS of the first step, step times;
  p2       SIZE^2 split [1, 2] over 2 ranks: the same, plus the time inside the halo exchange
           and the sums (the autograd Functions of ``deepfusion.engine.halo``, timed by wrapping
           them in this worker only), the messages and bytes they send, and an MPI ping-pong
           (latency and bandwidth) for the alpha-beta model of that traffic;
  p4       SIZE^2 split [2, 2] over 4 ranks: memory (4 ranks on a 2-core machine are
           oversubscribed: fine for memory, the time is an upper bound);
  big      BIG^2 split [2, 2] over 4 ranks with activation checkpointing
           (model option checkpoint_levels = true): peak memory per rank and step time
           (oversubscribed on 2 cores: an upper bound).
  --profile  where the split step loses time: SIZE x SIZE/2 undivided on 1 rank (one rank's
           share of the work, alone), the same on each of 2 ranks at once (data parallel: the
           cost of two ranks sharing the machine), and torch.profiler top ops of one step of
           the split rank and of the half-grid rank side by side.

Goals (the issue's; reported met / not met, never asserted):
  memory    peak RSS per rank <= 1.25 / P_domain of the undivided step's peak (the goal is on
            the peak RSS, VmHWM, as the issue states it; the ratio of the step's own memory,
            peak minus setup RSS, is reported next to it: the ~300-400 MB of torch and Python
            per process is not split);
  scaling   T(1 rank) / T(2 ranks, [1, 2]) >= 1.8 at SIZE^2, one thread per rank;
  big       BIG^2 (4096^2) trains split [2, 2] with checkpointing.

The measured figures, with the allocator as training sets it under a split (``--malloc-default``)
and with freed memory kept (the default here, ``parallel.reuse_memory = "on"``), are in the
README (Domain parallelism, "Measured"). What a ``--profile`` run of the first version found (before
the fused split norm, glibc's default allocator): the halo's buffer copies (~2.5 s of a 24.5 s
[1, 2] step), the split norm's plain ops (+2.3 s; now the fused kernel), two ranks sharing the
machine (+4 s at the same work) and page faults on fresh large tensors (system time 17.7 of the
39 s undivided step: what ``parallel.reuse_memory`` removes).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time

from bench.common import emit_json, load, median, mpi_cmd, peak_rss_mb, rss_mb, run_json

GOALS = {"memory_factor": 1.25, "strong_scaling_p2": 1.8, "big_field": 4096}
ALLOCATOR_ENV = ("GLIBC_TUNABLES", "LD_PRELOAD", "MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_",
                 "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX")
MOD = "bench.domain_bench"
REUSE_MEMORY = True  # the workers keep freed memory, as training does by default


# ---------------------------------------------------------------------------------------------
# worker (inside mpiexec)
# ---------------------------------------------------------------------------------------------

class HaloTimers:
    """Seconds inside the halo / sum autograd Functions (forward and backward) and inside the
    MPI calls of the halo exchange, with the messages and bytes each rank sends. Installed by
    wrapping ``deepfusion.engine.halo``'s Functions in this process only (bench instrumentation,
    the library is unchanged)."""

    KEYS = ("halo_fwd", "halo_bwd", "sum_fwd", "sum_bwd", "exchange", "gather_fwd", "gather_bwd")

    def __init__(self):
        from deepfusion.engine import halo

        self.reset()
        wrap = self._wrap
        orig_exchange = halo._exchange

        def exchange(block, axis, send_lo, send_hi, tag):
            t0 = time.perf_counter()
            out = orig_exchange(block, axis, send_lo, send_hi, tag)
            self.seconds["exchange"] += time.perf_counter() - t0
            for nb, buf in ((block.lo[axis], send_lo), (block.hi[axis], send_hi)):
                if nb is not None:
                    self.messages["halo"] += 1
                    self.bytes["halo"] += buf.numel() * buf.element_size()
            return out

        halo._exchange = exchange
        for key, cls in (("halo", halo._Halo), ("sum", halo._Sum), ("gather", halo._Gather)):
            cls.forward = staticmethod(wrap(cls.forward, key + "_fwd", key == "sum"))
            cls.backward = staticmethod(wrap(cls.backward, key + "_bwd", key == "sum"))

    def _wrap(self, fn, key, count):
        def timed(ctx, t, *args):
            t0 = time.perf_counter()
            out = fn(ctx, t, *args)
            self.seconds[key] += time.perf_counter() - t0
            if count:  # an allreduce of t's size: log2(P) messages of it per rank
                comm = ctx.comm
                n = max(1, math.ceil(math.log2(comm.size)))
                self.messages["sum"] += n
                self.bytes["sum"] += n * t.numel() * t.element_size()
            return out

        return timed

    def reset(self):
        self.seconds = {k: 0.0 for k in self.KEYS}
        self.messages = {"halo": 0, "sum": 0}
        self.bytes = {"halo": 0, "sum": 0}

    def snapshot(self) -> dict:
        s = dict(self.seconds)
        s["functions"] = sum(s[k] for k in self.KEYS if k != "exchange")
        # communication proper: the MPI calls of the halo plus the sums (an allreduce of B x C)
        s["comm"] = s["exchange"] + s["sum_fwd"] + s["sum_bwd"]
        return {"seconds": s, "messages": dict(self.messages), "bytes": dict(self.bytes)}


def halo_plan(model, task, block, x, checkpoint: bool) -> list[dict]:
    """The halos and reductions one step runs, from the network's layer list: every split
    convolution / upsampling (a halo of its padding / one replicated layer) and split instance
    norm (two sums of B x C), with each layer's input shape (recorded by a forward pre-hook in
    one forward without autograd), and the loss's finite-difference halo (the Burgers "stencil"
    residual: one layer of (2B, 1, *block)). ``passes`` = forward passes (2 when the levels
    are recomputed in backward by checkpointing; the output convolution and the loss are not
    checkpointed) + 1 backward (none for the halo of the network's input, which needs no
    gradient)."""
    import torch

    from diffnet.split_layers import SplitConv, SplitInstanceNorm, SplitUpsample

    rows, hooks = [], []
    for name, m in model.named_modules():
        if isinstance(m, (SplitConv, SplitUpsample, SplitInstanceNorm)):
            def pre(mod, args, name=name):
                shape = tuple(args[0].shape)
                # the network's input needs no gradient: its halo has no backward
                backward = int(args[0] is not x)
                if isinstance(mod, SplitConv):
                    rows.append({"layer": name, "kind": "halo", "shape": shape,
                                 "width": int(mod.padding[0]), "backward": backward})
                elif isinstance(mod, SplitUpsample):
                    rows.append({"layer": name, "kind": "halo", "shape": shape, "width": 1,
                                 "backward": backward})
                else:  # the fused NHWC norm all-reduces sum g and sum g xhat as one message
                    fused = args[0].dim() == 4 and not args[0].is_contiguous() and \
                        args[0].is_contiguous(memory_format=torch.channels_last)
                    rows.append({"layer": name, "kind": "sum", "shape": shape[:2], "count": 2,
                                 "backward": 1, "backward_messages": 1 if fused else 2})
            hooks.append(m.register_forward_pre_hook(pre))
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    for r in rows:
        r["backward_passes"] = r.pop("backward")
        r["passes"] = (2 if checkpoint else 1) + r["backward_passes"]
    # the Burgers stencil loss: FiniteDifference of cat([u, u^2 / 2]) on the block
    if getattr(task, "scheme", "stencil") == "stencil":
        rows.append({"layer": "loss.fd", "kind": "halo", "shape": (2 * x.shape[0], 1, *block.shape),
                     "width": 1, "passes": 2})
    return rows


def plan_traffic(rows, block, ranks: int) -> dict:
    """Messages and bytes this rank sends for ``rows`` (see :func:`halo_plan`), forward and
    backward: a halo of width w exchanges, axis by axis, one message per existing neighbour of
    B x C x w x (the other axes, those before this one already padded); its backward sends the
    same back. A sum is an allreduce of B x C floats: log2(P) messages of it."""
    msgs = {"halo": 0, "sum": 0}
    nbytes = {"halo": 0, "sum": 0}
    for r in rows:
        if r["kind"] == "sum":
            n = max(1, math.ceil(math.log2(ranks)))
            forward = r["passes"] - r["backward_passes"]
            msgs["sum"] += (forward * r["count"] + r["backward_passes"] * r["backward_messages"]) * n
            nbytes["sum"] += r["passes"] * r["count"] * n * 4 * r["shape"][0] * r["shape"][1]
            continue
        lvl = block.at_shape(r["shape"][2:])
        w, shape = r["width"], lvl.shape
        for a in range(lvl.dims):
            side = math.prod(n + 2 * w if b < a else n for b, n in enumerate(shape) if b != a)
            nb = (lvl.lo[a] is not None) + (lvl.hi[a] is not None)
            msgs["halo"] += r["passes"] * nb
            nbytes["halo"] += r["passes"] * nb * 4 * r["shape"][0] * r["shape"][1] * w * side
    return {"messages": msgs, "bytes": nbytes,
            "messages_total": sum(msgs.values()), "bytes_total": sum(nbytes.values())}


def pingpong(sizes=(8, 1024, 65536, 2**20, 4 * 2**20), reps_small=200, reps_big=20) -> dict:
    """Ranks 0 and 1: one-way time of a message (half the round trip of a ping-pong) and of a
    simultaneous exchange (Sendrecv both ways, as the halo does), per size; latency = the
    smallest size's one-way time, bandwidth from the 1 MiB and 4 MiB messages."""
    import numpy as np
    from mpi4py import MPI

    c = MPI.COMM_WORLD
    assert c.Get_size() == 2, "the ping-pong runs on exactly 2 ranks"
    rank = c.Get_rank()
    out = {}
    other = 1 - rank
    for n in sizes:
        a = np.zeros(max(1, n // 4), dtype=np.float32)
        b = np.empty_like(a)
        reps = reps_small if n <= 65536 else reps_big
        res = {}
        for mode in ("pingpong", "exchange"):
            ts = []
            for r in range(reps + 3):
                c.Barrier()
                t0 = time.perf_counter()
                if mode == "exchange":
                    c.Sendrecv(a, dest=other, sendtag=5, recvbuf=b, source=other, recvtag=5)
                elif rank == 0:
                    c.Send(a, dest=1, tag=3)
                    c.Recv(b, source=1, tag=4)
                else:
                    c.Recv(b, source=0, tag=3)
                    c.Send(a, dest=0, tag=4)
                dt = time.perf_counter() - t0
                if r >= 3:
                    ts.append(dt / 2 if mode == "pingpong" else dt)
            res[mode + "_us"] = median(ts) * 1e6
        out[str(4 * a.size)] = res
    small = out[str(4 * max(1, sizes[0] // 4))]
    alpha = small["pingpong_us"] * 1e-6
    bw = {}
    for mode in ("pingpong", "exchange"):
        big = [(int(k), v[mode + "_us"] * 1e-6) for k, v in out.items() if int(k) >= 2**20]
        bw[mode] = median([k / max(t - alpha, 1e-9) for k, t in big])
    return {"sizes": out, "latency_s": alpha,
            "exchange_latency_s": small["exchange_us"] * 1e-6,
            "bandwidth_Bps": bw["pingpong"], "exchange_bandwidth_Bps": bw["exchange"]}


def build_step(comm, grid, split, checkpoint: bool, global_batch: int = 1):
    """The engine's step on ``grid`` (split ``split`` over the ranks' domain groups): returns
    (step, model, task, block, x)."""
    import torch

    from deepfusion.config.sections import OptimConfig, ParallelConfig
    from deepfusion.engine.memformat import convert_model
    from deepfusion.engine.optim import FirstOrderStepper
    from deepfusion.engine.parallel import parallelize
    from deepfusion.engine.step import LossAndGrad
    from diffnet.generators import build_generator
    from diffnet.problems import get_problem

    grid = tuple(int(g) for g in grid)
    task = get_problem("burgers", grid=grid)
    torch.manual_seed(0)
    model = build_generator("unet", in_channels=len(task.input_channels),
                            checkpoint_levels=bool(checkpoint)).float()
    model = convert_model(model)  # model.channels_last = true, the training default
    pm = parallelize(model, comm, ParallelConfig(domain=list(split)), grid=grid)
    block = pm.block(grid)
    task = task.on_block(block)
    # The data-parallel unit's samples, each built on the whole grid (as InputCache does),
    # then this rank's block of it.
    local = global_batch // pm.data_size
    idx = range(pm.data_rank * local, (pm.data_rank + 1) * local)
    xs = []
    for i in idx:
        whole = task.build_input(task.sample_params(0, [i]), dtype=torch.float32)
        xs.append(block.local(whole[0]).contiguous())
        del whole
    x = torch.stack(xs)
    del xs
    ocfg = OptimConfig()
    lg = LossAndGrad(pm, task, global_batch=global_batch, term_names=tuple(task.loss_term_names),
                     channels_last=True, precision="fp32")
    opt = FirstOrderStepper("adam", pm.parameters(), ocfg, lg).optimizer

    def step():
        res = lg(x)
        if res.finite:
            lg.gs.clip_(ocfg.grad_clip, res.grad_norm)
            opt.step()
        return res

    return step, model, task, block, x


def worker(a) -> int:
    from deepfusion.engine.comm import world
    from deepfusion.engine.layout import setup_threads
    from deepfusion.engine.memory import reuse_freed_memory

    comm = world()
    setup_threads(comm, a.threads)  # before the first torch op
    reuse_freed_memory(not a.malloc_default)  # as deepfusion train does (parallel.reuse_memory)
    import gc

    import torch

    grid = (a.size, a.size // 2 if a.half else a.size)
    split = [int(s) for s in a.split.split(",")] if a.split else []
    timers = HaloTimers() if split and a.timers else None
    step, model, task, block, x = build_step(comm, grid, split, a.checkpoint,
                                             global_batch=comm.size if not split else 1)
    rec = {"rank": comm.rank, "ranks": comm.size, "grid": list(grid), "split": split,
           "block": list(block.shape), "threads": torch.get_num_threads(),
           "checkpoint_levels": bool(a.checkpoint), "loadavg": load()}
    gc.collect()
    rec["setup_rss_mb"] = rss_mb()
    rec["setup_peak_mb"] = peak_rss_mb()
    comm.barrier()
    t0 = time.perf_counter()
    res = step()  # the first step: its peak is the step's memory (Adam state included)
    rec["first_step_s"] = time.perf_counter() - t0
    rec["peak_rss_mb"] = peak_rss_mb()
    rec["step_increase_mb"] = rec["peak_rss_mb"] - rec["setup_rss_mb"]
    rec["loss"] = res.loss
    rec["finite"] = bool(res.finite)
    steps, halos, usage = [], [], []
    for _ in range(a.steps):
        if timers is not None:
            timers.reset()
        comm.barrier()
        u0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        res = step()
        steps.append(time.perf_counter() - t0)
        u1 = resource.getrusage(resource.RUSAGE_SELF)
        # user / system CPU seconds and minor page faults of the step (fresh pages of large
        # tensors are faulted in and zeroed by the kernel: system time)
        usage.append((u1.ru_utime - u0.ru_utime, u1.ru_stime - u0.ru_stime,
                      u1.ru_minflt - u0.ru_minflt))
        if timers is not None:
            halos.append(timers.snapshot())
    rec["finite"] = rec["finite"] and bool(res.finite)
    rec["step_s_all"] = steps
    rec["step_s"] = median(steps) if steps else rec["first_step_s"]
    rec["peak_rss_end_mb"] = peak_rss_mb()
    if usage:
        rec["user_s"], rec["sys_s"], rec["minor_faults"] = (median([u[i] for u in usage])
                                                            for i in range(3))
    if halos:
        rec["halo"] = {"seconds": {k: median([h["seconds"][k] for h in halos])
                                   for k in halos[0]["seconds"]},
                       "messages": halos[-1]["messages"], "bytes": halos[-1]["bytes"]}
    if timers is not None:  # after the measured steps: its forward must not raise the peak
        rows = halo_plan(model, task, block, x, bool(a.checkpoint))
        rec["plan"] = plan_traffic(rows, block, comm.size)
        rec["plan"]["layers"] = len(rows)
    if a.profile:
        rec["profile"] = profile_step(step)
    if a.pingpong and comm.size == 2:
        rec["pingpong"] = pingpong(**({"reps_small": 20, "reps_big": 5} if a.size <= 256 else {}))
    rec["loadavg_after"] = load()
    recs = comm.gather_obj(rec, 0)
    if comm.rank == 0:
        print(json.dumps({"ranks": recs}), flush=True)
    return 0


def profile_step(step, rows=25) -> dict:
    """torch.profiler's top ops (self CPU time) of one step: the split step against the
    undivided half grid shows what the split adds (the halo's copies, the split norm's ops)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as p:
        step()
    ev = sorted(p.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ev) or 1.0
    return {"total_ms": total / 1e3,
            "top_ops": [{"op": e.key, "self_ms": e.self_cpu_time_total / 1e3,
                         "share": e.self_cpu_time_total / total, "calls": e.count}
                        for e in ev[:rows]]}


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------

def launch(n, size, split, *, steps, checkpoint=False, timers=False, pingpong=False,
           profile=False, half=False, timeout=3600) -> dict:
    """One configuration as an mpiexec job; the per-rank records and their max over ranks."""
    args = ["--worker", "--size", str(size), "--split", ",".join(map(str, split)),
            "--steps", str(steps), "--checkpoint", str(int(checkpoint)), "--threads", "1"]
    args += ["--timers"] * timers + ["--pingpong"] * pingpong + ["--profile-step"] * profile
    args += ["--half"] * half + ["--malloc-default"] * (not REUSE_MEMORY)
    t0 = time.perf_counter()
    r = run_json(mpi_cmd(n, MOD, args), timeout=timeout, env={"OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - t0
    if "error" in r:
        return {"ranks_n": n, "split": split, "size": size, "error": r["error"], "wall_s": wall}
    recs = r["ranks"]
    out = {"ranks_n": n, "size": size, "grid": recs[0]["grid"], "split": split,
           "block": recs[0]["block"], "checkpoint_levels": checkpoint, "wall_s": wall,
           "finite": all(x["finite"] for x in recs), "loss": recs[0]["loss"],
           "loadavg": recs[0]["loadavg"], "loadavg_after": recs[0]["loadavg_after"]}
    for k in ("setup_rss_mb", "setup_peak_mb", "peak_rss_mb", "step_increase_mb",
              "peak_rss_end_mb", "first_step_s", "step_s"):
        out[k] = max(x[k] for x in recs)  # max over ranks
    # a step's time is its slowest rank's: max over ranks per step, then the median
    per_step = [max(x["step_s_all"][i] for x in recs) for i in range(len(recs[0]["step_s_all"]))]
    out["step_s_all"] = per_step
    out["step_s"] = median(per_step) if per_step else out["first_step_s"]
    for k in ("user_s", "sys_s", "minor_faults"):
        if k in recs[0]:
            out[k + "_per_rank"] = [x[k] for x in recs]
    if "halo" in recs[0]:
        out["halo_per_rank"] = [x["halo"] for x in recs]
        out["plan_per_rank"] = [x["plan"] for x in recs]
    if "pingpong" in recs[0]:
        out["pingpong"] = recs[0]["pingpong"]
    if "profile" in recs[0]:
        out["profile"] = recs[0]["profile"]
    return out


def halo_summary(p2: dict) -> dict:
    """The halo's share of the split step, and the alpha-beta prediction of its traffic."""
    halos, plans, pp = p2["halo_per_rank"], p2["plan_per_rank"], p2["pingpong"]
    alpha, beta = pp["latency_s"], pp["bandwidth_Bps"]
    step = p2["step_s"]
    sec = {k: max(h["seconds"][k] for h in halos) for k in halos[0]["seconds"]}
    pred = []
    for pl in plans:
        pred.append(pl["messages_total"] * alpha + pl["bytes_total"] / beta)
    counted = [{"messages": sum(h["messages"].values()), "bytes": sum(h["bytes"].values())}
               for h in halos]
    return {
        "step_s": step,
        "seconds": sec,                          # max over ranks, median over steps
        # the halo + sum Functions, forward + backward, their copies included
        "share_functions": sec["functions"] / step,
        "share_comm": sec["comm"] / step,        # the MPI calls only (exchange + allreduce)
        "model": {"latency_s": alpha, "bandwidth_Bps": beta,
                  "messages": max(pl["messages_total"] for pl in plans),
                  "bytes": max(pl["bytes_total"] for pl in plans),
                  "by_kind": plans[0]["messages"], "bytes_by_kind": plans[0]["bytes"],
                  "predicted_s": max(pred),
                  "predicted_exchange_bw_s": max(
                      pl["messages_total"] * alpha
                      + pl["bytes_total"] / pp["exchange_bandwidth_Bps"] for pl in plans)},
        "counted": counted[0] | {"per_rank": counted},
        "measured_comm_s": sec["comm"],
        "measured_over_predicted": sec["comm"] / max(pred) if max(pred) > 0 else float("nan"),
    }


def loss_check(res: dict) -> dict:
    """The first step's loss of every configuration against the undivided one's: the split is
    exact up to rounding, so a relative difference beyond ~1e-5 (fp32) means one of the two
    computes something else (e.g. the fused NHWC instance norm's fp32 sums over H x W, which
    lose accuracy on large grids)."""
    p1 = res.get("p1", {}).get("loss")
    out = {k: res[k]["loss"] for k in ("p1", "p2", "p4") if "loss" in res.get(k, {})}
    if p1:
        for k in ("p2", "p4"):
            if k in out:
                out[f"rel_diff_{k}"] = abs(out[k] - p1) / abs(p1)
    return out


def goals(res: dict) -> dict:
    """The issue's goals from the measured numbers ({} parts that did not run are left out)."""
    out = {}
    p1 = res.get("p1", {})
    for key, p in (("p2", 2), ("p4", 4)):
        r = res.get(key, {})
        if "peak_rss_mb" in r and "peak_rss_mb" in p1:
            goal = GOALS["memory_factor"] / p
            v = r["peak_rss_mb"] / p1["peak_rss_mb"]
            out[f"domain_memory_{key}_peak"] = {
                "value": v, "goal": round(goal, 4), "met": v <= goal, "on": "peak RSS (VmHWM)",
                "value_step_increase": r["step_increase_mb"] / p1["step_increase_mb"],
                "met_step_increase": r["step_increase_mb"] / p1["step_increase_mb"] <= goal}
    p2 = res.get("p2", {})
    if "step_s" in p2 and "step_s" in p1:
        v = p1["step_s"] / p2["step_s"]
        out["domain_strong_scaling_p2"] = {"value": v, "goal": GOALS["strong_scaling_p2"],
                                           "met": v >= GOALS["strong_scaling_p2"]}
    big = res.get("big")
    if big is not None:
        ok = "error" not in big and big.get("finite", False)
        v = big["size"] if ok else 0
        out["domain_big_field_p4"] = {"value": v, "goal": GOALS["big_field"],
                                      "met": ok and v >= GOALS["big_field"]}
    return out


def lines(res: dict) -> list[str]:
    """The domain part of the printed table."""
    out = []
    for key in ("p1", "p2", "p4", "big", "half_p1", "half_p2"):
        r = res.get(key)
        if not r:
            continue
        if "error" in r:
            out.append(f"domain {key}: failed: {r['error'][-300:]}")
            continue
        note = " (oversubscribed: time an upper bound)" if r["ranks_n"] > 2 else ""
        out.append(f"domain {key}: {'x'.join(map(str, r['grid']))} on {r['ranks_n']} rank(s) "
                   f"split {r['split'] or '-'} (block {'x'.join(map(str, r['block']))})"
                   f"{' ckpt' if r['checkpoint_levels'] else ''}: peak RSS/rank "
                   f"{r['peak_rss_mb']:.0f} MiB (setup {r['setup_rss_mb']:.0f}, step "
                   f"+{r['step_increase_mb']:.0f}), step {r['step_s']:.2f} s"
                   + (f" (system time {max(r['sys_s_per_rank']):.1f} s)" if "sys_s_per_rank" in r
                      else "") + note)
    h = res.get("halo")
    if h:
        m = h["model"]
        out.append(f"domain halo share of the p2 step: {h['share_functions']:.1%} in the halo/sum "
                   f"Functions ({h['seconds']['functions']:.3f} s), {h['share_comm']:.1%} in the "
                   f"MPI calls ({h['measured_comm_s']:.3f} s, waiting for the partner included); "
                   f"the rest is the halo's copies")
        out.append(f"domain alpha-beta: {m['messages']} messages, {m['bytes'] / 2**20:.1f} MiB per "
                   f"rank per step; latency {m['latency_s'] * 1e6:.1f} us, bandwidth "
                   f"{m['bandwidth_Bps'] / 1e9:.2f} GB/s -> predicted {m['predicted_s'] * 1e3:.1f} "
                   f"ms vs measured {h['measured_comm_s'] * 1e3:.1f} ms")
    lc = res.get("loss_check", {})
    if "rel_diff_p2" in lc:
        out.append(f"domain first-step loss: undivided {lc['p1']:.6g}, split [1, 2] {lc['p2']:.6g} "
                   f"(relative difference {lc['rel_diff_p2']:.1e})")
    pr = res.get("profile_summary")
    if pr:
        out.append("domain profile: " + ", ".join(f"{k} {v:.2f} s" for k, v in pr.items()
                                                  if isinstance(v, float)))
    return out


def profile_summary(res: dict) -> dict:
    """Where T(p2) goes against the ideal T(p1) / 2, from the --profile runs."""
    p1, p2 = res.get("p1", {}), res.get("p2", {})
    h1, h2 = res.get("half_p1", {}), res.get("half_p2", {})
    if not all("step_s" in r for r in (p1, p2, h1, h2)):
        return {}
    out = {"ideal_p2_s": p1["step_s"] / 2, "p2_s": p2["step_s"],
           "half_alone_s": h1["step_s"], "half_pair_s": h2["step_s"],
           "work_nonlinearity_s": h1["step_s"] - p1["step_s"] / 2,
           "sharing_machine_s": h2["step_s"] - h1["step_s"],
           "split_overhead_s": p2["step_s"] - h2["step_s"]}
    if res.get("halo"):
        out["halo_functions_s"] = res["halo"]["seconds"]["functions"]
        out["halo_comm_s"] = res["halo"]["measured_comm_s"]

    def ops(r):
        return {o["op"]: o["self_ms"] for o in r.get("profile", {}).get("top_ops", [])}

    a, b = ops(p2), ops(h2)
    if a and b:
        keys = sorted(set(a) | set(b), key=lambda k: -(a.get(k, 0) - b.get(k, 0)))
        out["ops_split_minus_half_ms"] = {k: round(a.get(k, 0) - b.get(k, 0), 1) for k in keys}
    return out


PARTS = ("p1", "p2", "p4", "big")


def run(size=2048, big=4096, steps=3, quick=False, profile=False, parts=PARTS,
        log=print) -> dict:
    """The configurations ``parts`` in turn (with ``profile``: also the half-grid controls and
    torch.profiler top ops of p1, p2 and the controls); the goals of the issue."""
    t_start = time.perf_counter()
    res = {"size": size, "big_size": big, "steps": steps, "batch": 1, "threads_per_rank": 1,
           "cores": os.cpu_count(), "loadavg": load(), "reuse_memory": REUSE_MEMORY,
           # the allocator settings the ranks inherit (they change the step time, see above)
           "allocator_env": {k: os.environ[k] for k in ALLOCATOR_ENV if k in os.environ}}
    if "p1" in parts or profile:
        res["p1"] = launch(1, size, [], steps=steps, profile=profile)
        log(f"  domain p1 {size}^2: {_brief(res['p1'])}")
    if "p2" in parts or profile:
        res["p2"] = launch(2, size, [1, 2], steps=steps, timers=True, pingpong=True,
                           profile=profile)
        log(f"  domain p2 {size}^2 [1, 2]: {_brief(res['p2'])}")
    if "p4" in parts:
        res["p4"] = launch(4, size, [2, 2], steps=0)
        log(f"  domain p4 {size}^2 [2, 2]: {_brief(res['p4'])}")
    if "big" in parts:
        res["big"] = launch(4, big, [2, 2], steps=1 if not quick else 0, checkpoint=True)
        log(f"  domain big {big}^2 [2, 2] ckpt: {_brief(res['big'])}")
    res["oversubscribed"] = {"ranks": 4, "cores": os.cpu_count(),
                             "upper_bound": 4 > (os.cpu_count() or 1),
                             "note": "4 ranks x 1 thread on fewer than 4 cores: the step times "
                                     "of p4 and big are upper bounds (memory is unaffected)"}
    if "halo_per_rank" in res.get("p2", {}) and "pingpong" in res["p2"]:
        res["halo"] = halo_summary(res["p2"])
    res["loss_check"] = loss_check(res)
    if profile:
        res["half_p1"] = launch(1, size, [], steps=steps, half=True, profile=True)
        log(f"  domain half p1 {size}x{size // 2}: {_brief(res['half_p1'])}")
        res["half_p2"] = launch(2, size, [], steps=steps, half=True, profile=True)
        log(f"  domain half p2 (data parallel) {size}x{size // 2}: {_brief(res['half_p2'])}")
        res["profile_summary"] = profile_summary(res)
    res["goals"] = goals(res)
    res["loadavg_end"] = load()
    res["seconds"] = time.perf_counter() - t_start
    return res


def _brief(r: dict) -> str:
    if "error" in r:
        return f"failed: {r['error'][-300:]}"
    return (f"peak {r['peak_rss_mb']:.0f} MiB/rank (+{r['step_increase_mb']:.0f} over setup), "
            f"step {r['step_s']:.2f} s, load {load()[0]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--split", default="", help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--timers", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--pingpong", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--profile-step", dest="profile_step", action="store_true",
                   help=argparse.SUPPRESS)
    p.add_argument("--half", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--malloc-default", dest="malloc_default", action="store_true",
                   help="glibc's default malloc (freed large blocks returned to the OS) instead "
                        "of training's default parallel.reuse_memory = true")
    p.add_argument("--size", type=int, default=2048, help="grid of the memory and scaling runs")
    p.add_argument("--big", type=int, default=4096, help="grid of the 4-rank checkpointed run")
    p.add_argument("--steps", type=int, default=3, help="timed steps after the first one")
    p.add_argument("--profile", action="store_true",
                   help="also the half-grid controls and torch.profiler top ops")
    p.add_argument("--parts", default=",".join(PARTS), help="comma list of " + ",".join(PARTS))
    p.add_argument("--quick", action="store_true", help="tiny sizes (128, 256; smoke test)")
    p.add_argument("--out")
    a = p.parse_args(argv)
    if a.worker:
        a.profile = a.profile_step
        return worker(a)
    if a.quick:
        a.size, a.big, a.steps = 128, 256, 1
    global REUSE_MEMORY
    REUSE_MEMORY = not a.malloc_default
    parts = tuple(filter(None, a.parts.split(",")))
    bad = set(parts) - set(PARTS)
    if bad:
        p.error(f"--parts: unknown {sorted(bad)}; valid: {','.join(PARTS)}")
    res = run(a.size, a.big, a.steps, quick=a.quick, profile=a.profile, parts=parts)
    for line in lines(res):
        print(line)
    for k, g in res["goals"].items():
        print(f"goal {k}: {g['value']:.3g} (goal {g['goal']}) {'MET' if g['met'] else 'not met'}")
    emit_json(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
