"""Scaling model for data-parallel DiffNet training: measured compute + alpha-beta allreduce.

    deepfusion jobs model --t-sample SECONDS [--t-sample-threads T] [--params N] --out DIR
    deepfusion jobs model --sweep DIR/sweep.json [--params N] --out DIR
    deepfusion jobs model --domain-grid 4096x4096 --t-sample S --t-sample-grid 2048x2048 --out DIR
        (domain parallelism, one sample split over the ranks: deepfusion/jobs/domain_model.py)

Model (one epoch, P = nodes x ranks_per_node ranks, T threads per rank):

    t_rank(T)    = t1 * (s + (1 - s) / T)                         Amdahl over the rank's threads
    T_allreduce  = min(ring, recursive doubling)                   MPI libraries switch algorithms
        ring     = 2 (P-1) alpha + 2 (P-1)/P * bytes / beta
        rec.dbl. = ceil(log2 P) * (alpha + bytes / beta)           the talk's O(N_w + log p)
    T_epoch      = ceil(N_samples / P) * t_rank(T) + steps_per_epoch * T_allreduce
    steps_per_epoch = N_samples // global_batch,  bytes = 4 * parameters (float32 gradients)

alpha/beta are the profile's link_latency_us / link_bandwidth_GBps (shm_* on one node): a flat
allreduce over all P ranks limited by the slowest (network) link. P = 1 has no communication.
efficiency(n) = T_epoch(1 node) / (n * T_epoch(n nodes)) at fixed global batch (strong scaling).

``validation_table()`` calibrates t_rank per cluster from the talk's 1-node 64x64 time, predicts
the 2/4-node and 128x128/256x256 times and returns them next to the published numbers.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from deepfusion.app.checks import check_output_dir
from deepfusion.jobs import domain_model
from deepfusion.jobs.costs import NODES, allreduce_time, amdahl, link_params, plot_efficiency
from deepfusion.jobs.profiles import get_profile, load_profiles, profile_names

# The talk (Botelho et al., DeepFusion): per-epoch wall-clock seconds, batch 1024,
# 4 processes per node x 8 threads per process.  (resolution, nodes) -> seconds.
PUBLISHED = {
    "aws-c5n": {(64, 1): 131.0, (64, 2): 65.2, (64, 4): 32.4, (128, 4): 138.4, (256, 4): 650.5},
    "azure-hc44": {(64, 1): 113.1, (64, 2): 54.9, (64, 4): 28.6, (128, 4): 126.2, (256, 4): 597.6},
    "stampede2": {(64, 1): 67.2, (64, 2): 34.9, (64, 4): 19.4, (128, 4): 68.5, (256, 4): 279.8},
}
TALK_RANKS_PER_NODE = 4
TALK_THREADS = 8
TALK_BATCH = 1024
TALK_SAMPLES = 4096  # the talk's scaling runs: "Batch size 1024 (4096 training examples)"
DEFAULT_PARAMS = 2_000_000
DEFAULT_SERIAL_FRACTION = 0.05
MODEL_CLUSTERS = ["stampede2", "azure-hc44", "aws-c5n", "generic-slurm"]


# ----------------------------------------------------------------------------- epochs
def epoch_time(nodes: int, ranks_per_node: int, t_rank: float, prof: dict, params: int = DEFAULT_PARAMS,
               n_samples: int = TALK_SAMPLES, global_batch: int = TALK_BATCH) -> dict | None:
    """Predicted epoch for one layout; None when P ranks cannot split the global batch."""
    p = nodes * ranks_per_node
    if p > global_batch:
        return None
    nbytes = 4.0 * params
    alpha, beta = link_params(prof, nodes)
    t_ar, algo = allreduce_time(p, nbytes, alpha, beta)
    steps = max(1, n_samples // global_batch)
    t_comp = math.ceil(n_samples / p) * t_rank
    t_comm = steps * t_ar
    return dict(nodes=nodes, ranks=p, t_compute=t_comp, t_comm=t_comm, t_epoch=t_comp + t_comm,
                t_allreduce=t_ar, algorithm=algo, steps_per_epoch=steps, comm_share=t_comm / (t_comp + t_comm))


def predict(prof: dict, t_sample: float, t_ref_threads: int = 1, params: int = DEFAULT_PARAMS,
            nodes_list=NODES, ranks_per_node: int | None = None, threads_per_rank: int | None = None,
            serial_fraction: float = DEFAULT_SERIAL_FRACTION, n_samples: int = TALK_SAMPLES,
            global_batch: int = TALK_BATCH) -> list[dict]:
    """Strong-scaling prediction over ``nodes_list`` for one profile (its default layout)."""
    r = ranks_per_node or prof["ranks_per_node"]
    t = threads_per_rank or prof["threads_per_rank"]
    t_rank = amdahl(t_sample, t_ref_threads, t, serial_fraction)
    rows, base = [], None
    for n in nodes_list:
        row = epoch_time(n, r, t_rank, prof, params, n_samples, global_batch)
        if row is None:
            continue
        if base is None:
            base = (n, row["t_epoch"])
        row.update(ranks_per_node=r, threads_per_rank=t, t_sample_rank=t_rank,
                   speedup=base[1] / row["t_epoch"], efficiency=base[1] * base[0] / (n * row["t_epoch"]))
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- validation
def validation_table(params: int = DEFAULT_PARAMS, profiles: dict | None = None,
                     n_samples: int = TALK_SAMPLES, global_batch: int = TALK_BATCH) -> list[dict]:
    """Predicted vs published per-epoch times and ratios for the talk's table.

    Per cluster, t_rank (s/sample on one 8-thread rank) is calibrated so the model reproduces the
    1-node 64x64 time exactly; everything else is predicted: 2 and 4 nodes (compute / P + alpha-beta
    allreduce) and 128x128 / 256x256 on 4 nodes (compute proportional to pixels; the U-Net is fully
    convolutional so the parameter count, hence the allreduce, does not change).
    """
    profiles = load_profiles() if profiles is None else profiles
    rows = []
    for cluster, pub in PUBLISHED.items():
        prof = get_profile(cluster, profiles)
        r = TALK_RANKS_PER_NODE
        one = epoch_time(1, r, 1.0, prof, params, n_samples, global_batch)
        t_rank = (pub[(64, 1)] - one["t_comm"]) / math.ceil(n_samples / r)
        pred = {}
        for (res, nodes) in pub:
            scale = (res / 64) ** 2
            pred[(res, nodes)] = epoch_time(nodes, r, t_rank * scale, prof, params, n_samples, global_batch)
        for (res, nodes), t_pub in pub.items():
            e = pred[(res, nodes)]
            rows.append(dict(cluster=cluster, resolution=res, nodes=nodes, published_s=t_pub,
                             predicted_s=round(e["t_epoch"], 3), predicted_comm_s=e["t_comm"],
                             t_sample_rank=t_rank, core_s_per_sample=t_rank * TALK_THREADS))
        ratios = {
            "2n/1n @64": (pub[(64, 2)] / pub[(64, 1)], pred[(64, 2)]["t_epoch"] / pred[(64, 1)]["t_epoch"]),
            "4n/1n @64": (pub[(64, 4)] / pub[(64, 1)], pred[(64, 4)]["t_epoch"] / pred[(64, 1)]["t_epoch"]),
            "128/64 @4n": (pub[(128, 4)] / pub[(64, 4)], pred[(128, 4)]["t_epoch"] / pred[(64, 4)]["t_epoch"]),
            "256/64 @4n": (pub[(256, 4)] / pub[(64, 4)], pred[(256, 4)]["t_epoch"] / pred[(64, 4)]["t_epoch"]),
        }
        for name, (p_, m_) in ratios.items():
            rows.append(dict(cluster=cluster, ratio=name, published=round(p_, 4), predicted=round(m_, 4),
                             rel_error=round((m_ - p_) / p_, 4)))
    return rows


def format_validation(rows: list[dict]) -> str:
    out = ["| cluster | ratio | published | predicted | model error |", "|---|---|---:|---:|---:|"]
    for r in rows:
        if "ratio" in r:
            out.append(f"| {r['cluster']} | {r['ratio']} | {r['published']:.3f} | {r['predicted']:.3f} | "
                       f"{100 * r['rel_error']:+.1f}% |")
    out += ["", "| cluster | domain | nodes | published s/epoch | predicted s/epoch | predicted comm s |",
            "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if "published_s" in r:
            out.append(f"| {r['cluster']} | {r['resolution']}x{r['resolution']} | {r['nodes']} | "
                       f"{r['published_s']:.1f} | {r['predicted_s']:.1f} | {r['predicted_comm_s']:.4f} |")
    return "\n".join(out)


# ----------------------------------------------------------------------------- inputs
def t_sample_from_sweep(path: str | os.PathLike) -> dict:
    """Per-sample compute time of one rank from a deepfusion.jobs.sweep sweep.json.

    Uses the 1-rank layouts (no communication): t(T) = (time_step - time_allreduce) / global_batch.
    With two or more thread counts, fits t(T) = a + b/T and returns the Amdahl serial fraction
    s = a / (a + b); otherwise s is None (use the default).
    """
    data = json.loads(Path(path).read_text())
    rows = [r for r in data["layouts"] if r["ranks"] == 1 and r.get("median_time_step")]
    if not rows:
        raise ValueError(f"{path}: no 1-rank layout with step times; run the sweep with a 1xT layout")
    pts = sorted({r["threads"]: (r["median_time_step"] * (1 - (r.get("allreduce_share") or 0.0)))
                  / r["global_batch"] for r in rows}.items())
    t_ref_threads, t_sample = pts[0]
    s = None
    if len(pts) >= 2:
        xs = [1.0 / t for t, _ in pts]
        ys = [y for _, y in pts]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
        a = my - b * mx
        if a + b > 0:
            s = min(1.0, max(0.0, a / (a + b)))
    return dict(t_sample=t_sample, t_ref_threads=t_ref_threads, serial_fraction=s, points=pts)


def build_parser(prog: str = "deepfusion jobs model") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--t-sample", type=float, help="measured compute seconds per sample on one rank")
    src.add_argument("--sweep", metavar="SWEEP_JSON",
                     help="a sweep.json of 'deepfusion jobs sweep' to take the per-sample time from")
    p.add_argument("--t-sample-threads", type=int, default=1, help="threads of the rank that measured --t-sample")
    p.add_argument("--serial-fraction", type=float, default=None,
                   help=f"Amdahl serial fraction for thread scaling (default {DEFAULT_SERIAL_FRACTION}, "
                        "or fitted from --sweep)")
    p.add_argument("--params", type=int, default=None,
                   help=f"model parameters (gradient = 4 bytes each); default {DEFAULT_PARAMS}, "
                        "with --domain-grid the U-Net's own count")
    p.add_argument("--samples", type=int, default=TALK_SAMPLES, help="samples per epoch (default 4096)")
    p.add_argument("--global-batch", type=int, default=TALK_BATCH, help="global batch (default 1024)")
    p.add_argument("--clusters", default=",".join(MODEL_CLUSTERS),
                   help=f"comma-separated profile names of deepfusion/jobs/clusters.toml "
                        f"({', '.join(profile_names())}) or of the --profiles file "
                        f"(default {','.join(MODEL_CLUSTERS)})")
    p.add_argument("--profiles", default=None, help="extra profile TOML merged over deepfusion/jobs/clusters.toml")
    p.add_argument("--ranks-per-node", type=int, default=None, help="ranks per node (default: the profile's)")
    p.add_argument("--threads-per-rank", type=int, default=None, help="threads per rank (default: the profile's)")
    p.add_argument("--out", required=True, help="output directory (model.json, model.png; domain.json, domain.png)")
    domain_model.add_arguments(p)
    return p


def compute_inputs(args) -> tuple[float, int, float]:
    """(t_sample, threads it was measured with, serial fraction) from --t-sample or --sweep."""
    for name in ("t_sample_threads", "ranks_per_node", "threads_per_rank"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.sweep:
        fit = t_sample_from_sweep(args.sweep)
        s = args.serial_fraction if args.serial_fraction is not None else (
            fit["serial_fraction"] if fit["serial_fraction"] is not None else DEFAULT_SERIAL_FRACTION)
        return fit["t_sample"], fit["t_ref_threads"], s
    if args.t_sample <= 0:
        raise ValueError("--t-sample must be > 0")
    s = DEFAULT_SERIAL_FRACTION if args.serial_fraction is None else args.serial_fraction
    return args.t_sample, args.t_sample_threads, s


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_output_dir(args.out, flag="--out")
        t_sample, t_ref, s = compute_inputs(args)
        if args.domain_grid:
            return domain_model.run(args, t_sample, t_ref, s)
        if args.t_sample_grid or args.domain_split:
            raise ValueError("--t-sample-grid and --domain-split need --domain-grid")
        args.params = DEFAULT_PARAMS if args.params is None else args.params
        profiles = load_profiles(args.profiles)
        names = [c.strip() for c in args.clusters.split(",") if c.strip()]
        results = {n: predict(get_profile(n, profiles), t_sample, t_ref, args.params, serial_fraction=s,
                              ranks_per_node=args.ranks_per_node, threads_per_rank=args.threads_per_rank,
                              n_samples=args.samples, global_batch=args.global_batch) for n in names}
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    val = validation_table(args.params, profiles)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = dict(inputs=dict(t_sample=t_sample, t_ref_threads=t_ref, serial_fraction=s, params=args.params,
                           gradient_bytes=4 * args.params, samples=args.samples, global_batch=args.global_batch),
               predictions=results, validation=val)
    (out / "model.json").write_text(json.dumps(doc, indent=2))
    plot_efficiency(results, out / "model.png",
                    f"t_sample={t_sample:.3g}s @{t_ref} thr, s={s:.2f}, {args.params / 1e6:.1f}M params, "
                    f"batch {args.global_batch}, {args.samples} samples")
    print(f"{'cluster':<15}{'nodes':>6}{'ranks':>7}{'t_epoch s':>12}{'comm s':>10}{'algo':>20}{'eff':>7}")
    for name, rows in results.items():
        for r in rows:
            print(f"{name:<15}{r['nodes']:>6}{r['ranks']:>7}{r['t_epoch']:>12.3f}{r['t_comm']:>10.4f}"
                  f"{r['algorithm']:>20}{r['efficiency']:>7.3f}")
    print()
    print("Validation against the DeepFusion talk (t_rank calibrated on each cluster's 1-node 64x64 time):")
    print(format_validation(val))
    print(f"\nwrote {out / 'model.json'} and {out / 'model.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
