"""Domain parallelism (``parallel.domain``): memory per rank, strong scaling of one large sample,
and the biggest field that trains, with real mpiexec jobs.

    python -m bench.domain_bench [--size 2048] [--big 4096] [--steps 3] [--out FILE] [--quick]
                                 [--parts p1,p2,p2copy,p4,big] [--profile]

(``python -m bench.run --with-domain`` runs it too; not in the default ``make bench``: the full
run takes minutes, ``--quick`` less.)

Configurations (each its own ``mpiexec -n P python -m bench.domain_worker ...`` job, so
high-water marks do not mix; every rank reports, the driver takes the max over ranks). All run
the engine's path: the default generator ("unet", default options) and the Burgers problem
(default options), fp32, channels_last; ``parallelize`` with the domain split, the problem's
``on_block``, the inputs built on the whole grid and cut with ``block.local``,
:class:`~deepfusion.engine.train.step.LossAndGrad` and Adam. Batch 1, one thread per rank.

  p1       SIZE^2 undivided on 1 rank: setup RSS, peak RSS of the first step, step times;
  p2       SIZE^2 split [1, 2] over 2 ranks: the same, plus the time inside the halo exchange
           and the sums (the autograd Functions of ``deepfusion.engine.parallel.halo``, timed by wrapping
           them in this worker only), the messages and bytes they send, and an MPI ping-pong
           (latency and bandwidth) for the alpha-beta model of that traffic;
  p2copy   p2 with the split convolutions on a padded copy of the block (``Block.halo``, the
           alternative to ``diffnet.ghost_conv``): the copy-free convolutions' gain, side by side;
  p4       SIZE^2 split [2, 2] over 4 ranks: memory (on fewer than 4 cores the ranks are
           oversubscribed: fine for memory, the time is an upper bound);
  big      BIG^2 split [2, 2] over 4 ranks with activation checkpointing
           (model option checkpoint_levels = true): peak memory per rank and step time
           (oversubscribed on fewer than 4 cores: an upper bound).
  --profile  where the split step loses time: SIZE x SIZE/2 undivided on 1 rank (one rank's
           share of the work, alone), the same on each of 2 ranks at once (data parallel: the
           cost of two ranks sharing the machine), and torch.profiler top ops of one step of
           the split rank and of the half-grid rank side by side.

Goals (reported met / not met, never asserted):
  memory    peak RSS per rank <= 1.25 / P_domain of the undivided step's peak (the goal is on
            the peak RSS, VmHWM; the ratio of the step's own memory, peak minus setup RSS, is
            reported next to it: the few hundred MB of torch and Python per process is not
            split);
  scaling   T(1 rank) / T(2 ranks, [1, 2]) >= 1.8 at SIZE^2, one thread per rank;
  big       BIG^2 (4096^2) trains split [2, 2] with checkpointing.

Run it with the allocator as training sets it under a split (``--malloc-default``) and with
freed memory kept (the default here, ``parallel.reuse_memory = "on"``) to see what each costs
(one run's figures: lab/notes/readme-second-release.md, "Domain parallelism"). ``--profile``
shows where a split step's time goes beyond the halo: the halo's buffer copies, the split
norm, two ranks sharing the machine, and page faults on fresh large tensors (what
``parallel.reuse_memory`` removes).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from bench.common import emit_json, load, median, mpi_cmd, run_json

GOALS = {"memory_factor": 1.25, "strong_scaling_p2": 1.8, "big_field": 4096}
ALLOCATOR_ENV = ("GLIBC_TUNABLES", "LD_PRELOAD", "MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_",
                 "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX")
MOD = "bench.domain_worker"  # the worker module, one configuration per mpiexec job
REUSE_MEMORY = True  # the workers keep freed memory, as training does by default


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------

def launch(n, size, split, *, steps, checkpoint=False, timers=False, pingpong=False,
           profile=False, half=False, halo_copy=False, timeout=3600) -> dict:
    """One configuration as an mpiexec job; the per-rank records and their max over ranks."""
    args = ["--size", str(size), "--split", ",".join(map(str, split)),
            "--steps", str(steps), "--checkpoint", str(int(checkpoint)), "--threads", "1"]
    args += ["--timers"] * timers + ["--pingpong"] * pingpong + ["--profile-step"] * profile
    args += ["--half"] * half + ["--malloc-default"] * (not REUSE_MEMORY)
    args += ["--halo-copy"] * halo_copy
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


def copy_free(res: dict) -> dict:
    """The copy-free split convolutions against padded copies: p2 and p2copy side by side
    ({} unless both ran)."""
    p2, copy = res.get("p2", {}), res.get("p2copy", {})
    if "step_s" not in p2 or "step_s" not in copy:
        return {}
    return {"step_s": p2["step_s"], "step_s_padded_copies": copy["step_s"],
            "speedup": copy["step_s"] / p2["step_s"], "peak_rss_mb": p2["peak_rss_mb"],
            "peak_rss_mb_padded_copies": copy["peak_rss_mb"],
            "loss_rel_diff": abs(copy["loss"] - p2["loss"]) / abs(p2["loss"])}


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
    """The goals from the measured numbers ({} parts that did not run are left out)."""
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
    for key in ("p1", "p2", "p2copy", "p4", "big", "half_p1", "half_p2"):
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
                   f"Functions and ghost slabs ({h['seconds']['functions']:.3f} s), "
                   f"{h['share_comm']:.1%} in the MPI calls ({h['measured_comm_s']:.3f} s, waiting for the partner included); "
                   f"the rest builds the ghost layers (copies)")
        out.append(f"domain alpha-beta: {m['messages']} messages, {m['bytes'] / 2**20:.1f} MiB per "
                   f"rank per step; latency {m['latency_s'] * 1e6:.1f} us, bandwidth "
                   f"{m['bandwidth_Bps'] / 1e9:.2f} GB/s -> predicted {m['predicted_s'] * 1e3:.1f} "
                   f"ms vs measured {h['measured_comm_s'] * 1e3:.1f} ms")
    cf = res.get("copy_free")
    if cf:
        out.append(f"domain p2 split convolutions: copy-free {cf['step_s']:.2f} s per step, on "
                   f"padded copies {cf['step_s_padded_copies']:.2f} s ({cf['speedup']:.2f}x)")
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


PARTS = ("p1", "p2", "p2copy", "p4", "big")


def run(size=2048, big=4096, steps=3, quick=False, profile=False, parts=PARTS,
        log=print) -> dict:
    """The configurations ``parts`` in turn (with ``profile``: also the half-grid controls and
    torch.profiler top ops of p1, p2 and the controls); the goals."""
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
    if "p2copy" in parts:
        res["p2copy"] = launch(2, size, [1, 2], steps=steps, timers=True, halo_copy=True)
        log(f"  domain p2copy {size}^2 [1, 2], padded copies: {_brief(res['p2copy'])}")
        res["copy_free"] = copy_free(res)
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
