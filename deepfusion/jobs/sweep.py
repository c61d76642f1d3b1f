"""Scaling study driver: run `deepfusion train` for several ranks x threads layouts and aggregate.

    deepfusion jobs sweep --config CONFIG --layouts 1x2,2x1,2x2,4x1 --mode strong|weak --steps N --out DIR
                          [--global-batch 64 | --local-batch 16] [--launcher "mpiexec"] [--oversubscribe]
                          [--cluster NAME --nodes N]        # on a cluster: that profile's launcher + binding
                          [--sbatch [--sbatch-args "-p q"] [--time 00:30:00]]  # each layout as a batch job
    deepfusion jobs sweep --aggregate-only --out DIR ...    # re-read DIR/runs/*/metrics.jsonl

A layout is ``RxT`` (R ranks x T threads per rank; on a cluster R is ranks per node). Strong
scaling keeps the global batch fixed; weak scaling keeps the local batch fixed (global = local * P).
Every layout runs in DIR/runs/<nodes>n<R>x<T>/ and writes metrics.jsonl; the aggregation below is a
pure function of those files and writes DIR/sweep.json, DIR/sweep.csv and DIR/sweep.png. Before any
layout runs or is submitted, each one's `deepfusion train` start-up is checked (deepfusion.jobs.precheck);
--sbatch is in deepfusion.jobs.sweep_sbatch.

Definitions (all per layout, steps after the first ``--warmup`` steps only):
    median_time_step   median over steps of the step time (slowest rank if several ranks log)
    samples_per_s      global_batch / median_time_step
    time_epoch_est     steps_per_epoch * median_time_step, steps_per_epoch = samples_per_epoch // global_batch
    allreduce_share    sum(time_allreduce) / sum(time_step)
    cores              nodes * ranks * threads
    baseline           the layout with the fewest cores (ties: fewest ranks, i.e. prefer 1 rank)
    speedup            samples_per_s / samples_per_s(baseline)
    efficiency         speedup / (cores / cores(baseline))       (strong and weak alike: throughput
                       per core relative to the baseline; weak scaling at fixed cores per rank reduces
                       to t_step(baseline) / t_step)
    vs_threads_only    samples_per_s / samples_per_s(1 rank x cores threads) when that layout ran:
                       > 1 means MPI ranks beat threads on the same cores
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from deepfusion.app.checks import check_output_dir
from deepfusion.jobs.precheck import check_job
from deepfusion.jobs.profiles import get_profile, load_profiles
from deepfusion.jobs.render import check_layout, cluster_help, launch_argv
from deepfusion.jobs.sweep_sbatch import site_profiles, submit_layouts

TIME = "00:30:00"  # --sbatch: each layout's time limit unless --time says otherwise
CSV_FIELDS = ["nodes", "ranks", "threads", "cores", "global_batch", "local_batch", "steps_measured",
              "median_time_step", "time_epoch_est", "time_epoch_measured", "samples_per_s", "speedup",
              "efficiency", "vs_threads_only", "allreduce_share", "status"]


# ----------------------------------------------------------------------------- layouts
def parse_layouts(text: str) -> list[tuple[int, int]]:
    """'1x2,2x1' -> [(1, 2), (2, 1)] (ranks, threads)."""
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        parts = item.split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"layout {item!r} must look like RxT (ranks x threads), e.g. 2x4")
        out.append((int(parts[0]), int(parts[1])))
    if not out:
        raise ValueError("no layouts given")
    return out


def check_layouts(layouts, cores_available: int, oversubscribe: bool = False) -> None:
    for r, t in layouts:
        if r * t > cores_available and not oversubscribe:
            raise ValueError(f"layout {r}x{t} needs {r * t} cores but only {cores_available} are available "
                             f"(pass --oversubscribe to run it anyway; timings will be meaningless)")


# ----------------------------------------------------------------------------- aggregation
def read_metrics(path: str | os.PathLike) -> tuple[list[dict], list[dict]]:
    """(step records, epoch records) from a metrics.jsonl; malformed lines are skipped."""
    steps, epochs = [], []
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(rec, dict):
                continue
            if rec.get("kind") == "step" and "time_step" in rec:
                steps.append(rec)
            elif rec.get("kind") == "epoch" and "time_epoch" in rec:
                epochs.append(rec)
    return steps, epochs


def summarize_run(path: str | os.PathLike, warmup: int = 2) -> dict:
    """Per-run statistics from one metrics.jsonl (see module docstring)."""
    steps, epochs = read_metrics(path)
    by_step: dict[int, list[dict]] = {}
    for rec in steps:
        by_step.setdefault(int(rec.get("step", len(by_step))), []).append(rec)
    ordered = [by_step[k] for k in sorted(by_step)]
    if len(ordered) > warmup:
        ordered = ordered[warmup:]
    elif ordered:  # too few steps: keep the last one rather than nothing
        ordered = ordered[-1:]
    ts = [max(r["time_step"] for r in recs) for recs in ordered]
    ar = [statistics.fmean(r.get("time_allreduce", 0.0) or 0.0 for r in recs) for recs in ordered]
    sps = [statistics.fmean(r["samples_per_s"] for r in recs if "samples_per_s" in r)
           for recs in ordered if any("samples_per_s" in r for r in recs)]
    ep = [e["time_epoch"] for e in epochs]
    if len(ep) >= 2:
        ep = ep[1:]  # the first epoch carries start-up and warm-up
    return dict(
        steps_measured=len(ts),
        median_time_step=statistics.median(ts) if ts else None,
        allreduce_share=(sum(ar) / sum(ts)) if ts and sum(ts) > 0 else None,
        median_samples_per_s_logged=statistics.median(sps) if sps else None,
        time_epoch_measured=statistics.median(ep) if ep else None,
    )


def aggregate(runs: list[dict], samples_per_epoch: int, warmup: int = 2, mode: str = "strong") -> list[dict]:
    """Pure aggregation. ``runs``: dicts with ranks, threads, global_batch, metrics (path) and
    optionally nodes (default 1) and status. Returns one row per run with the CSV_FIELDS."""
    rows = []
    for run in runs:
        nodes = int(run.get("nodes", 1))
        r, t, gb = int(run["ranks"]), int(run["threads"]), int(run["global_batch"])
        p = nodes * r
        row = dict(nodes=nodes, ranks=r, threads=t, cores=p * t, global_batch=gb,
                   local_batch=gb // p if p else None, status=run.get("status", "ok"), mode=mode)
        m = Path(run["metrics"]) if run.get("metrics") else None
        if m is not None and m.exists():
            row.update(summarize_run(m, warmup))
        else:
            row.update(steps_measured=0, median_time_step=None, allreduce_share=None,
                       median_samples_per_s_logged=None, time_epoch_measured=None)
            if row["status"] == "ok":
                row["status"] = "no metrics"
        ts = row["median_time_step"]
        row["samples_per_s"] = gb / ts if ts else None
        row["time_epoch_est"] = max(1, samples_per_epoch // gb) * ts if ts else None
        rows.append(row)

    ok = [x for x in rows if x["samples_per_s"]]
    base = min(ok, key=lambda x: (x["cores"], x["nodes"] * x["ranks"])) if ok else None
    threads_only = {x["cores"]: x for x in ok if x["nodes"] * x["ranks"] == 1}
    for x in rows:
        x["baseline"] = f"{base['nodes']}n{base['ranks']}x{base['threads']}" if base else None
        if x["samples_per_s"] and base:
            x["speedup"] = x["samples_per_s"] / base["samples_per_s"]
            x["efficiency"] = x["speedup"] / (x["cores"] / base["cores"])
        else:
            x["speedup"] = x["efficiency"] = None
        ref = threads_only.get(x["cores"])
        x["vs_threads_only"] = x["samples_per_s"] / ref["samples_per_s"] if ref and x["samples_per_s"] else None
    return rows


def write_outputs(rows: list[dict], out: str | os.PathLike, meta: dict | None = None) -> dict:
    """DIR/sweep.json (meta + layouts), DIR/sweep.csv (CSV_FIELDS), DIR/sweep.png."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    doc = dict(meta=meta or {}, definitions=__doc__.split("Definitions")[1].strip() if "Definitions" in __doc__
               else "", layouts=rows)
    (out / "sweep.json").write_text(json.dumps(doc, indent=2))
    with open(out / "sweep.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else (round(r[k], 6) if isinstance(r[k], float) else r[k]))
                        for k in CSV_FIELDS})
    plot(rows, out / "sweep.png", (meta or {}).get("mode", ""))
    return doc


def plot(rows: list[dict], path: str | os.PathLike, mode: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in rows if r.get("samples_per_s")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    labels = [f"{r['nodes']}n{r['ranks']}x{r['threads']}" if r["nodes"] > 1 else f"{r['ranks']}x{r['threads']}"
              for r in ok]
    xs = range(len(ok))
    axes[0].bar(xs, [r["samples_per_s"] for r in ok], color="tab:blue")
    axes[0].set_ylabel("samples/s")
    axes[1].bar(xs, [r["efficiency"] for r in ok], color="tab:green")
    axes[1].axhline(1.0, color="k", lw=0.8, ls="--")
    axes[1].set_ylabel("parallel efficiency")
    comp = [r["median_time_step"] * (1 - (r["allreduce_share"] or 0)) for r in ok]
    comm = [r["median_time_step"] * (r["allreduce_share"] or 0) for r in ok]
    axes[2].bar(xs, comp, label="compute + other", color="tab:orange")
    axes[2].bar(xs, comm, bottom=comp, label="allreduce", color="tab:red")
    axes[2].set_ylabel("median step time (s)")
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, rotation=30)
        ax.set_xlabel("layout (ranks x threads)")
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"DeepFusion {mode} scaling sweep".strip())
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- running
def layout_dir(out: Path, nodes: int, r: int, t: int) -> Path:
    return out / "runs" / f"{nodes}n{r}x{t}"


def build_command(r: int, t: int, nodes: int, config: str, run_dir: Path, global_batch: int, steps: int,
                  launcher: str | None = None, profile: dict | None = None, oversubscribe: bool = False,
                  deepfusion: str | None = None, extra_sets=()) -> list[str]:
    """argv for one layout. With ``profile`` uses deepfusion.jobs.render.launch_argv (cluster binding);
    otherwise ``launcher`` (default: the venv's mpiexec) with MPICH Hydra core binding."""
    if profile is not None:
        pre = launch_argv(profile, nodes, r, t)
    else:
        pre = shlex.split(launcher) if launcher else [str(Path(sys.executable).parent / "mpiexec")]
        pre = pre + ["-n", str(r)]
        if not oversubscribe and Path(pre[0]).name in ("mpiexec", "mpiexec.hydra"):
            pre += ["-bind-to", f"core:{t}"]
    train = shlex.split(deepfusion) if deepfusion else [sys.executable, "-m", "deepfusion"]
    sets = [f"parallel.threads_per_rank={t}", f"data.global_batch={global_batch}", f"train.max_steps={steps}",
            "train.log_every=1", f"run.dir={run_dir}", *extra_sets]
    return pre + train + ["train", config] + [a for kv in sets for a in ("--set", kv)]


def run_sweep(args) -> list[dict]:
    out = Path(args.out)
    layouts = parse_layouts(args.layouts)
    profile = None
    if args.cluster:
        profile = get_profile(args.cluster, load_profiles(args.profiles))
        for r, t in layouts:
            check_layout(profile, args.nodes, r, t)
    else:
        check_layouts(layouts, os.cpu_count() or 1, args.oversubscribe)
    plan = []
    for r, t in layouts:
        p = args.nodes * r
        gb = args.global_batch if args.mode == "strong" else args.local_batch * p
        if gb % p:
            raise ValueError(f"global batch {gb} is not divisible by {p} ranks (layout {r}x{t})")
        plan.append((r, t, gb, layout_dir(out, args.nodes, r, t)))
    check_plan(args, plan)  # every layout, before anything runs or is submitted
    for *_, rd in plan:
        rd.mkdir(parents=True, exist_ok=True)
        (rd / "metrics.jsonl").unlink(missing_ok=True)
        shutil.rmtree(rd / "checkpoints", ignore_errors=True)  # else train finds a run there
    if args.sbatch:
        return submit_layouts(args, plan, [layout_sets(args, gb) for _, _, gb, _ in plan])
    runs = []
    for r, t, gb, rd in plan:
        cmd = build_command(r, t, args.nodes, args.config, rd, gb, args.steps, args.launcher, profile,
                            args.oversubscribe, args.deepfusion, tuple(args.extra_sets))
        env = dict(os.environ, OMP_NUM_THREADS=str(t), MKL_NUM_THREADS=str(t), OMP_PROC_BIND="close",
                   OMP_PLACES="cores")
        print(f"[sweep] {r}x{t} global_batch={gb}: {shlex.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        with open(rd / "stdout.log", "w") as log:
            proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)
        status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
        print(f"[sweep] {r}x{t} {status} in {time.perf_counter() - t0:.1f} s", flush=True)
        runs.append(dict(nodes=args.nodes, ranks=r, threads=t, global_batch=gb, metrics=rd / "metrics.jsonl",
                         status=status, command=shlex.join(cmd)))
    return runs


def layout_sets(args, global_batch: int) -> list[str]:
    """The --set items every layout's train gets besides its threads and run directory."""
    return [f"data.global_batch={global_batch}", f"train.max_steps={args.steps}", "train.log_every=1",
            *args.extra_sets]


def check_plan(args, plan) -> None:
    """The start-up of every layout's ``deepfusion train`` (deepfusion.jobs.precheck.check_job), and with
    --sbatch the profile's placeholders: ValueError before the first layout runs."""
    if args.sbatch:
        site_profiles(args)
    for r, t, gb, _ in plan:
        for w in check_job(args.config, layout_sets(args, gb), args.nodes, r, t, None):
            print(f"[sweep] {r}x{t} warning: {w}", flush=True)


def discover_runs(out: Path, mode: str, global_batch: int, local_batch: int) -> list[dict]:
    """Runs already in DIR/runs/<nodes>n<R>x<T> (for --aggregate-only)."""
    runs = []
    for d in sorted((out / "runs").glob("*n*x*")):
        n, rt = d.name.split("n", 1)
        r, t = (int(v) for v in rt.split("x"))
        p = int(n) * r
        runs.append(dict(nodes=int(n), ranks=r, threads=t, metrics=d / "metrics.jsonl",
                         global_batch=global_batch if mode == "strong" else local_batch * p))
    return runs


def build_parser(prog: str = "deepfusion jobs sweep") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="training config (TOML)")
    p.add_argument("--layouts", default="1x1,1x2,2x1", help="comma-separated RxT (ranks x threads)")
    p.add_argument("--mode", choices=("strong", "weak"), default="strong",
                   help="strong: fixed global batch (--global-batch); weak: fixed batch per rank "
                        "(--local-batch) (default strong)")
    p.add_argument("--steps", type=int, default=20, help="training steps per layout (train.max_steps)")
    p.add_argument("--warmup", type=int, default=2, help="steps skipped before taking medians")
    p.add_argument("--global-batch", type=int, default=64, help="strong scaling: fixed global batch")
    p.add_argument("--local-batch", type=int, default=16, help="weak scaling: fixed local batch")
    p.add_argument("--samples-per-epoch", type=int, default=4096, help="for the per-epoch estimate")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="output directory: runs/<nodes>n<R>x<T>/ per layout, sweep.json, "
                        "sweep.csv, sweep.png")
    p.add_argument("--launcher", default=None, help='launcher prefix, e.g. "mpiexec" (default: the venv\'s mpiexec)')
    p.add_argument("--oversubscribe", action="store_true", help="allow ranks x threads > cores (no binding)")
    p.add_argument("--cluster", default=None,
                   help=cluster_help("use this profile's launcher and binding (inside an allocation)"))
    p.add_argument("--nodes", type=int, default=1, help="nodes per layout (default 1)")
    p.add_argument("--profiles", default=None, help="extra TOML profile file merged over deepfusion/jobs/clusters.toml")
    p.add_argument("--deepfusion", default=None, help='training command (default: "python -m deepfusion")')
    p.add_argument("--set", dest="extra_sets", action="append", default=[], metavar="KEY=VALUE",
                   help="extra --set passed to deepfusion train (repeatable)")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds per layout, a hang guard (--sbatch: times the number of layouts, in all)")
    p.add_argument("--sbatch", action="store_true",
                   help="submit each layout as its own batch job (needs --cluster), wait, then aggregate")
    p.add_argument("--sbatch-args", default="", help='--sbatch: extra sbatch options, e.g. "-p debug -A proj"')
    p.add_argument("--partition", default=None, metavar="NAME",
                   help="--sbatch: the Slurm partition of the scripts, over the profile's")
    p.add_argument("--account", default=None, metavar="NAME",
                   help="--sbatch: the Slurm account of the scripts, over the profile's")
    p.add_argument("--time", default=None, metavar="HH:MM:SS",
                   help=f"--sbatch: time limit of each layout's job (default {TIME})")
    p.add_argument("--aggregate-only", action="store_true", help="do not run; aggregate DIR/runs/*")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.time = args.time or TIME
    out = Path(args.out)
    try:
        check_output_dir(args.out, flag="--out", create=not args.aggregate_only)
        if args.aggregate_only:
            runs = discover_runs(out, args.mode, args.global_batch, args.local_batch)
        else:
            if not args.config:
                raise ValueError("--config is required unless --aggregate-only")
            if args.sbatch and not args.cluster:
                raise ValueError("--sbatch needs --cluster (the profile whose job script each layout runs)")
            runs = run_sweep(args)
    except (ValueError, subprocess.TimeoutExpired) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = aggregate(runs, args.samples_per_epoch, args.warmup, args.mode)
    meta = dict(mode=args.mode, config=args.config, steps=args.steps, warmup=args.warmup,
                samples_per_epoch=args.samples_per_epoch, host_cores=os.cpu_count(),
                commands=[str(r.get("command", "")) for r in runs])
    write_outputs(rows, out, meta)
    print(f"{'layout':<10}{'batch':>7}{'t_step s':>10}{'samples/s':>11}{'eff':>7}{'allreduce':>10}  status")
    for r in rows:
        f = lambda v, fmt: format(v, fmt) if v is not None else "-"  # noqa: E731
        print(f"{r['nodes']}n{r['ranks']}x{r['threads']:<6}{r['global_batch']:>7}{f(r['median_time_step'], '10.4f')}"
              f"{f(r['samples_per_s'], '11.1f')}{f(r['efficiency'], '7.3f')}{f(r['allreduce_share'], '10.3f')}"
              f"  {r['status']}")
    print(f"wrote {out / 'sweep.json'}, {out / 'sweep.csv'}, {out / 'sweep.png'}")
    bad = [r for r in rows if r["status"] != "ok"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
