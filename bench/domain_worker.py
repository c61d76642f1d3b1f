"""The worker of ``bench.domain_bench``: one configuration inside ``mpiexec``, every rank
reporting its memory, step times and (with ``--timers``) the halo exchange's time and traffic.

    mpiexec -n P python -m bench.domain_worker --size N --split 1,2 --steps 3 [--checkpoint 1]
                       [--timers] [--pingpong] [--profile-step] [--half] [--malloc-default]

Rank 0 prints one JSON line ``{"ranks": [record per rank]}``; the driver (bench/domain_bench.py)
launches it, takes the max over ranks and writes the report. What each configuration is and
what the goals are: the driver's docstring.
"""
from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time

from bench.common import load, median, peak_rss_mb, rss_mb


class HaloTimers:
    """Seconds inside the halo / sum autograd Functions (forward and backward) and inside the
    MPI calls of the halo exchange, with the messages and bytes each rank sends. Installed by
    wrapping ``deepfusion.engine.parallel.halo``'s Functions in this process only (bench instrumentation,
    the library is unchanged)."""

    KEYS = ("halo_fwd", "halo_bwd", "sum_fwd", "sum_bwd", "exchange", "gather_fwd", "gather_bwd",
            "slabs_fwd", "slabs_bwd")

    def __init__(self):
        from deepfusion.engine.parallel import halo
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
        # the copy-free convolutions' exchange: slabs built and sent, gradients returned (their
        # thin corrections are convolutions, counted with the network)
        block = halo.MPIBlock
        block.ghost_slabs = wrap(block.ghost_slabs, "slabs_fwd", False)
        block.add_ghost_grads = wrap(block.add_ghost_grads, "slabs_bwd", False)

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


def halo_plan(model, problem, block, x, checkpoint: bool) -> list[dict]:
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
    if getattr(problem, "scheme", "stencil") == "stencil":
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
    (step, model, problem, block, x)."""
    import torch

    from bench.step_bench import engine_step
    from deepfusion.config.sections import ParallelConfig
    from deepfusion.engine.parallel.memformat import convert_model
    from deepfusion.engine.parallel.parallelize import parallelize
    from deepfusion.engine.train.step import LossAndGrad
    from diffnet.generators import build_generator
    from diffnet.problems import get_problem

    grid = tuple(int(g) for g in grid)
    problem = get_problem("burgers", grid=grid)
    torch.manual_seed(0)
    model = build_generator("unet", in_channels=len(problem.input_channels),
                            checkpoint_levels=bool(checkpoint)).float()
    model = convert_model(model)  # model.channels_last = true, the training default
    pm = parallelize(model, comm, ParallelConfig(domain=list(split)), grid=grid)
    block = pm.block(grid)
    problem = problem.on_block(block)
    # The data-parallel unit's samples, each built on the whole grid (as InputCache does),
    # then this rank's block of it.
    local = global_batch // pm.data_size
    idx = range(pm.data_rank * local, (pm.data_rank + 1) * local)
    xs = []
    for i in idx:
        whole = problem.build_input(problem.sample_params(0, [i]), dtype=torch.float32)
        xs.append(block.local(whole[0]).contiguous())
        del whole
    x = torch.stack(xs)
    del xs
    lg = LossAndGrad(pm, problem, global_batch=global_batch,
                     term_names=tuple(problem.loss_term_names), channels_last=True,
                     precision="fp32")
    return engine_step(lg, pm.parameters(), x), model, problem, block, x


def worker(a) -> int:
    from deepfusion.engine.parallel.comm import world
    from deepfusion.engine.parallel.layout import setup_threads
    from deepfusion.engine.parallel.memory import reuse_freed_memory

    comm = world()
    setup_threads(comm, a.threads)  # before the first torch op
    reuse_freed_memory(not a.malloc_default)  # as deepfusion train does (parallel.reuse_memory)
    import gc

    import torch

    grid = (a.size, a.size // 2 if a.half else a.size)
    split = [int(s) for s in a.split.split(",")] if a.split else []
    timers = HaloTimers() if split and a.timers else None
    if a.halo_copy:  # the padded-copy alternative to diffnet.ghost_conv: a copy of every block
        from deepfusion.engine.parallel.halo import MPIBlock
        MPIBlock.thin_ghosts = False
    step, model, problem, block, x = build_step(comm, grid, split, a.checkpoint,
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
        rows = halo_plan(model, problem, block, x, bool(a.checkpoint))
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, required=True, help="grid N (N x N; N x N/2 with --half)")
    p.add_argument("--split", default="", help="domain split, e.g. 1,2 (empty: undivided)")
    p.add_argument("--steps", type=int, default=3, help="timed steps after the first one")
    p.add_argument("--checkpoint", type=int, default=0, help="1: activation checkpointing")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timers", action="store_true", help="time the halo Functions")
    p.add_argument("--pingpong", action="store_true", help="MPI ping-pong (2 ranks)")
    p.add_argument("--profile-step", dest="profile", action="store_true",
                   help="torch.profiler top ops of one step")
    p.add_argument("--halo-copy", dest="halo_copy", action="store_true",
                   help="split convolutions on a padded copy (Block.halo), not copy-free")
    p.add_argument("--half", action="store_true", help="N x N/2 (one rank's share of [1, 2])")
    p.add_argument("--malloc-default", dest="malloc_default", action="store_true",
                   help="glibc's default malloc instead of parallel.reuse_memory")
    return worker(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
