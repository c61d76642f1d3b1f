"""Gradient communication and the ranks x threads layout, with real MPI processes.

    python -m bench.comm_bench [--grid 64 --batch 16] [--repeats 3] [--steps 6]

Parts (every MPI part is an ``mpiexec -n P python -m bench.comm_bench --worker ...`` job):
  allreduce  our allreduce (comm.allreduce_: mpi4py in-place Allreduce on a numpy view) against
             torch.distributed gloo all_reduce of the same float32 buffer, P=2, interleaved;
  buckets    GradSync.reduce() of the default generator's gradient for several parallel.bucket_mb;
  overlap    P=2 x 1 thread training steps with parallel.overlap off / on / on without
             GradSync's progress polling (interleaved): the step time and the share of it
             spent blocked in the allreduce, and per rank the gradient all-reduce's wait for
             the other rank, its move and what the step waits for after backward (exposed;
             the step record's allreduce_* fields, deepfusion/engine/parallel/commstats.py),
             medians over the steps; again in a second launch with MPICH's
             asynchronous progress thread (MPICH_ASYNC_PROGRESS=1, which needs
             MPI_THREAD_MULTIPLE: the record says the thread level granted);
  layout     P=2 ranks x 1 thread against P=1 x 2 threads on the same global batch: launches
             alternate, each reports the median step time of ``--steps`` steps.
Every worker keeps freed memory for reuse, as ``deepfusion train`` does without a domain split
(``parallel.reuse_memory``).
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import time

from bench.common import emit_json, load, median, mpi_cmd, run_json


# ---------------------------------------------------------------------------------------------
# worker (inside mpiexec)
# ---------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup(threads: int):
    from deepfusion.engine.parallel.comm import world
    from deepfusion.engine.parallel.layout import setup_threads
    from deepfusion.engine.parallel.memory import reuse_freed_memory

    comm = world()
    setup_threads(comm, threads)  # before the first torch op
    reuse_freed_memory(True)  # as `deepfusion train` runs without a domain split (the default)
    return comm


def worker_allreduce(comm, sizes_mb, repeats) -> dict:
    import torch
    import torch.distributed as dist

    port = comm.bcast_obj(_free_port() if comm.rank == 0 else None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank,
                            world_size=comm.size)
    out = {}
    for mb in sizes_mb:
        n = int(mb * 2**20 / 4)
        a, b = torch.ones(n), torch.ones(n)
        for _ in range(2):  # warm-up both paths (connections, registration)
            comm.allreduce_(a)
            dist.all_reduce(b)
        tm, tg = [], []
        for _ in range(repeats):
            comm.barrier()
            t0 = time.perf_counter()
            comm.allreduce_(a)
            tm.append(time.perf_counter() - t0)
            comm.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(b)
            tg.append(time.perf_counter() - t0)
        out[f"{mb:g}"] = {"bytes": 4 * n, "mpi_ms": median(tm) * 1e3, "gloo_ms": median(tg) * 1e3,
                          "gloo_over_mpi": median(tg) / median(tm)}
    dist.destroy_process_group()
    return out


def worker_buckets(comm, bucket_mbs, repeats, generator="unet") -> dict:
    from bench.common import build
    from deepfusion.engine.parallel.gradsync import GradSync

    _, model = build("burgers", 64, generator)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    out = {"grad_bytes": nbytes, "bucket_mb": {}}
    syncs = {mb: GradSync(model, comm, bucket_mb=mb) for mb in bucket_mbs}
    times = {mb: [] for mb in bucket_mbs}
    for r in range(repeats + 1):
        for mb, gs in syncs.items():  # each GradSync re-points .grad at its own buckets: fine here
            comm.barrier()
            gs.reduce()
            if r:
                times[mb].append(gs.seconds)
    for mb in bucket_mbs:
        out["bucket_mb"][f"{mb:g}"] = {"buckets": len(syncs[mb].buckets),
                                       "reduce_ms": median(times[mb]) * 1e3}
    return out


def _engine(comm, grid, global_batch, *, overlap, bucket_mb, generator="unet", poll=True):
    from bench.common import build, inputs
    from bench.step_bench import make_deepfusion
    task, model = build("burgers", grid, generator)  # make_deepfusion broadcasts it
    local = global_batch // comm.size
    x = inputs(task, global_batch)[comm.rank * local:(comm.rank + 1) * local]
    return make_deepfusion(task, model, x, comm=comm, overlap=overlap, bucket_mb=bucket_mb,
                           global_batch=global_batch, poll=poll)


# The step record's per-rank lists (commstats) a record of the overlap part keeps, as medians.
PER_RANK = ("enter_s", "wait_s", "move_s", "exposed_s", "progress_s")


def worker_overlap(comm, grid, global_batch, steps, bucket_mb) -> dict:
    engines = {"no_overlap": _engine(comm, grid, global_batch, overlap=False, bucket_mb=bucket_mb),
               "overlap": _engine(comm, grid, global_batch, overlap=True, bucket_mb=bucket_mb),
               "overlap_no_poll": _engine(comm, grid, global_batch, overlap=True,
                                          bucket_mb=bucket_mb, poll=False)}
    rec = {k: {"step": [], "allreduce": [], "compute": [], "comm": []} for k in engines}
    for r in range(steps + 1):
        for k, f in engines.items():
            comm.barrier()
            t0 = time.perf_counter()
            f()
            dt = time.perf_counter() - t0
            if r:
                rec[k]["step"].append(dt)
                rec[k]["allreduce"].append(f.times["allreduce"])
                rec[k]["compute"].append(f.times["forward"] + f.times["backward"])
                rec[k]["comm"].append(dict(f.comm))
    out = {}
    for k, v in rec.items():
        s, a = median(v["step"]), median(v["allreduce"])
        # the interleaved rounds' own times: "the step falls" is judged round by round (run.py)
        out[k] = {"step_s": s, "allreduce_s": a, "allreduce_share": a / s,
                  "step_s_rounds": v["step"], "compute_s": median(v["compute"]),
                  **per_rank(v["comm"], s)}
    return out


def per_rank(records: list[dict], step_s: float) -> dict:
    """The gradient all-reduce of the steps' records (``allreduce_*`` fields): per rank the
    median of each list over the steps, the bytes, and the exposed share of the step (the mean
    over ranks of the exposed seconds, median over steps, over the median step); None each
    where nothing was accounted (one rank)."""
    if not records or not all(records):
        return {**{k: None for k in PER_RANK}, "bytes": None, "exposed_share": None}
    out = {k: [median(col) for col in zip(*(r[f"allreduce_{k}"] for r in records))]
           for k in PER_RANK}
    exposed = median([sum(r["allreduce_exposed_s"]) / len(r["allreduce_exposed_s"])
                      for r in records])
    return {**out, "bytes": records[0]["allreduce_bytes"], "exposed_share": exposed / step_s}


def thread_level() -> str:
    """The MPI thread support this process was granted (async progress needs "multiple")."""
    from mpi4py import MPI

    names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
             MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
    return names.get(MPI.Query_thread(), "unknown")


def worker_layout(comm, grid, global_batch, steps) -> dict:
    import torch

    f = _engine(comm, grid, global_batch, overlap=False, bucket_mb=4.0)
    f()
    ts, cs, ar = [], [], []
    for _ in range(steps):
        comm.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        f()
        ts.append(time.perf_counter() - t0)
        cs.append(time.process_time() - c0)
        ar.append(f.times["allreduce"])
    return {"ranks": comm.size, "threads": torch.get_num_threads(), "step_s": median(ts),
            "cpu_s": median(cs), "allreduce_s": median(ar), "samples_per_s": global_batch / median(ts),
            "step_s_all": ts}


def worker(a) -> int:
    comm = _setup(a.threads)
    out = {"loadavg": load(), "mpi_thread_level": thread_level()}
    parts = a.parts.split(",")
    if "allreduce" in parts:
        out["allreduce"] = worker_allreduce(comm, [float(v) for v in a.sizes_mb.split(",")], a.repeats_ar)
    if "buckets" in parts:
        out["buckets"] = worker_buckets(comm, [float(v) for v in a.bucket_mbs.split(",")], a.repeats_ar)
    if "overlap" in parts:
        out["overlap"] = worker_overlap(comm, a.grid, a.batch, a.steps, a.bucket_mb)
    if "layout" in parts:
        out["layout"] = worker_layout(comm, a.grid, a.batch, a.steps)
    out["loadavg_after"] = load()
    if comm.rank == 0:
        print(json.dumps(out), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------

def _worker_args(parts, threads, **kw) -> list[str]:
    args = ["--worker", "--parts", parts, "--threads", str(threads)]
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return args


def run(grid=64, batch=16, steps=6, repeats=3, sizes_mb="5.43,7.8", bucket_mbs="1,2,4,8,64",
        repeats_ar=20, bucket_mb=4.0, log=print) -> dict:
    out = {}
    mod = "bench.comm_bench"
    r = run_json(mpi_cmd(2, mod, _worker_args("allreduce,buckets,overlap", 1, grid=grid,
                                              batch=batch, steps=steps, sizes_mb=sizes_mb,
                                              bucket_mbs=bucket_mbs, repeats_ar=repeats_ar,
                                              bucket_mb=bucket_mb)))
    out.update(r)
    if "error" not in r:
        for mb, v in r["allreduce"].items():
            log(f"  allreduce {mb} MB P=2: ours {v['mpi_ms']:.2f} ms, gloo {v['gloo_ms']:.2f} ms")
        log("  buckets: " + ", ".join(f"{mb} MB -> {v['reduce_ms']:.2f} ms"
                                      for mb, v in r["buckets"]["bucket_mb"].items()))
        log("  P=2x1 allreduce share: " + _shares(r["overlap"]))
    else:
        log(f"  comm worker failed: {r['error'][-300:]}")
    out["async_progress_thread_level"], out["overlap_async_progress"] = overlap_async_progress(
        grid, batch, steps, bucket_mb, log)
    # layout: alternate launches so both layouts see the same load
    runs = {"P1xT2": [], "P2xT1": []}
    for _ in range(repeats):
        for key, (n, t) in (("P1xT2", (1, 2)), ("P2xT1", (2, 1))):
            res = run_json(mpi_cmd(n, mod, _worker_args("layout", t, grid=grid, batch=batch,
                                                        steps=steps)))
            if "layout" in res:
                res["layout"]["loadavg"] = res["loadavg"]
                runs[key].append(res["layout"])
            else:
                log(f"  layout {key} failed: {res.get('error', '')[-300:]}")
    lay = {"grid": grid, "global_batch": batch, "launches": runs}
    for key, rs in runs.items():
        if rs:
            lay[key] = {"step_s": median([x["step_s"] for x in rs]),
                        "step_s_best": min(x["step_s"] for x in rs),  # least disturbed launch
                        "cpu_s": median([x["cpu_s"] for x in rs]),
                        "allreduce_s": median([x["allreduce_s"] for x in rs])}
    if "P1xT2" in lay and "P2xT1" in lay:
        lay["P2xT1_speedup"] = lay["P1xT2"]["step_s"] / lay["P2xT1"]["step_s"]
        log(f"  layout {grid}^2 b{batch}: P=1x2 {lay['P1xT2']['step_s'] * 1e3:.0f} ms, "
            f"P=2x1 {lay['P2xT1']['step_s'] * 1e3:.0f} ms (x{lay['P2xT1_speedup']:.2f})")
    out["layout"] = lay
    return out


def _shares(overlap: dict) -> str:
    return ", ".join(f"{k} {v['allreduce_share']:.1%} of {v['step_s'] * 1e3:.0f} ms"
                     + (f" (exposed {v['exposed_share']:.1%}: wait "
                        f"{'/'.join(f'{x * 1e3:.1f}' for x in v['wait_s'])} ms, move "
                        f"{'/'.join(f'{x * 1e3:.1f}' for x in v['move_s'])} ms per rank)"
                        if v.get("exposed_share") is not None else "")
                     for k, v in overlap.items())


def overlap_async_progress(grid, batch, steps, bucket_mb, log=print) -> tuple[str, dict]:
    """The overlap part again, its own launch, with MPICH's asynchronous progress thread on:
    a third thread per rank moves the started allreduce while backward computes (on a node
    with no spare core it takes its cycles from the ranks' compute threads). Returns the MPI
    thread level granted and the overlap part's records ({} if the launch failed)."""
    r = run_json(mpi_cmd(2, "bench.comm_bench", _worker_args(
        "overlap", 1, grid=grid, batch=batch, steps=steps, bucket_mb=bucket_mb)),
        env={"MPICH_ASYNC_PROGRESS": "1"})
    if "error" in r:
        log(f"  async-progress worker failed: {r['error'][-300:]}")
        return "unknown", {}
    log(f"  P=2x1 with MPICH_ASYNC_PROGRESS=1 (thread level {r['mpi_thread_level']}): "
        + _shares(r["overlap"]))
    return r["mpi_thread_level"], r["overlap"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--parts", default="allreduce,buckets,overlap,layout")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--grid", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--repeats-ar", type=int, default=20)
    p.add_argument("--sizes-mb", default="5.43,7.8")
    p.add_argument("--bucket-mbs", default="1,2,4,8,64")
    p.add_argument("--bucket-mb", type=float, default=4.0)
    p.add_argument("--out")
    a = p.parse_args(argv)
    if a.worker:
        return worker(a)
    res = run(a.grid, a.batch, a.steps, a.repeats, a.sizes_mb, a.bucket_mbs, a.repeats_ar,
              a.bucket_mb)
    emit_json(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
