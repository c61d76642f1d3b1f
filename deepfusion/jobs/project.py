"""Projected time to accuracy on a cluster: steps to a target against the global batch (measured,
``lab/tools/batch_study.py``) times the modelled step time of the best layout for each node count.

    deepfusion jobs project --study STUDY.json --family FAMILY --t-sample S --grid 64x64 \
        [--t-sample-threads 1] [--nodes 1,4,16,64] [--clusters stampede2,azure-hc44,aws-c5n] \
        [--domain] [--overlap] [--measured RUN_OR_BENCH_JSON ...] --out DIR

For every cluster, node count, global batch B the study reached the target with (its steps
S(B), the fewest over the study's learning-rate rules) and layout (ranks per node r dividing the
cores, T = cores / r threads each, and with ``--domain`` a split of each sample over ``k`` ranks
as ``parallel.domain``), with P = nodes x r ranks in G = P / k data-parallel groups (G must
divide B):

    t_sample(k)  = deepfusion.jobs.domain_model.domain_step's compute + halo + norm time of one sample on k
                   ranks (k = 1: amdahl(t_sample, T)),
    T_step       = C + allreduce(P, 4 * params),  C = ceil(B / G) * t_sample(k)
                   (with --overlap: C + max(0, allreduce - h C), the all-reduce hidden
                   behind the backward pass as ``parallel.overlap`` does; h = 2/3, a bound,
                   or measured with --measured, which also adds the measured arrival skew:
                   deepfusion.jobs.measured)
    time         = S(B) * T_step

and the projection is the fastest (B, layout). Measured: S(B) (the study, on two cores) and
t_sample (on this machine). Modelled: everything else (Amdahl over threads, the alpha-beta
links of deepfusion/jobs/clusters.toml, the halo exchanges); a cluster's cores are taken as fast as this
machine's, so the figures compare layouts and node counts, not CPUs. The per-sample time does
not shrink with the batch (micro-batches run one after another).

With ``--config RECIPE`` instead of a study, the recipe's own plan is projected at its own batch
(so at its measured test error), domain splits carrying it past the batch
(``deepfusion.jobs.project_recipe``); ``--t-sample`` is then optional, one figure per level, and measured
by ``deepfusion check``'s probe when left out. ``--combine A/project.json B/project.json``
puts projections side by side (``deepfusion.jobs.project_summary``). Every projection says
which all-reduce model it used and, per cluster, what limits its speed-up at 16 nodes
(``deepfusion.jobs.project_limits``: compute, halo, all-reduce or skew).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from deepfusion.app.checks import check_output_dir
from deepfusion.engine.errors import InputError
from deepfusion.jobs import project_limits
from deepfusion.jobs import project_recipe as pr
from deepfusion.jobs.costs import allreduce_time, amdahl, link_params
from deepfusion.jobs.domain_model import Net, choose_split, domain_step, parse_grid
from deepfusion.jobs.measured import measured_model
from deepfusion.jobs.model import DEFAULT_SERIAL_FRACTION
from deepfusion.jobs.profiles import get_profile, load_profiles, node_layouts
from deepfusion.jobs.project_summary import combine

DEFAULT_CLUSTERS = "stampede2,azure-hc44,aws-c5n"


def steps_to_target(study: dict, family: str) -> dict[int, dict]:
    """{batch: {"steps", "rule"}}: the fewest loss evaluations to the target per batch over the
    rules, counted in batches (an L-BFGS step evaluates the loss, and all-reduces its gradient,
    once per line-search trial: its ``samples_to_target`` / batch, not its step count)."""
    best: dict[int, dict] = {}
    for row in study["arms"]:
        if row["family"] != family or not row.get("steps_to_target"):
            continue
        b = int(row["batch"])
        s = int(row.get("samples_to_target") or b * row["steps_to_target"]) // b
        if b not in best or s < best[b]["steps"]:
            best[b] = {"steps": s, "rule": row["rule"]}
    if not best:
        families = sorted({r["family"] for r in study["arms"]})
        raise ValueError(f"the study has no arm of family {family!r} that reached its target "
                         f"(families: {', '.join(families)})")
    return best


def sample_time(net: Net, grid, k: int, r: int, t_rank: float, prof: dict, depth: int):
    """(seconds of one sample on k ranks, of them exchanges, split or None); None when no valid
    split exists."""
    if k == 1:
        return t_rank, 0.0, None
    split = choose_split(grid, k, depth)
    if split is None:
        return None
    row = domain_step(net, grid, split, min(r, k), t_rank, prof, params=0)
    if row is None:
        return None
    return row["t_compute"] + row["t_halo"] + row["t_norm"], row["t_halo"] + row["t_norm"], \
        list(split)


def best_plan(prof: dict, nodes: int, steps: dict, args, net: Net) -> dict | None:
    best = None
    for r, threads in node_layouts(prof):
        p = nodes * r
        t_rank = amdahl(args.t_sample, args.t_sample_threads, threads, args.serial_fraction)
        alpha, beta = link_params(prof, nodes)
        t_grad = allreduce_time(p, 4.0 * args.params, alpha, beta)[0]
        for k in ([d for d in range(1, p + 1) if p % d == 0] if args.domain else [1]):
            per = sample_time(net, args.grid, k, r, t_rank, prof, net.depth)
            if per is None:
                continue
            groups = p // k
            for b, s in steps.items():
                if b % groups:
                    continue
                compute = (b // groups) * per[0]
                wait = args.allreduce.wait(t_grad, compute, args.overlap)
                skew = args.allreduce.skew(compute)
                t_step = compute + wait + skew
                halo = (b // groups) * per[1]
                parts = project_limits.shares({"compute": compute - halo, "halo": halo,
                                               "allreduce": wait, "skew": skew})
                row = dict(nodes=nodes, batch=b, rule=s["rule"], steps=s["steps"],
                           ranks_per_node=r, threads_per_rank=threads, ranks=p, domain=per[2],
                           t_step=t_step, hours=s["steps"] * t_step / 3600, parts=parts)
                if best is None or row["hours"] < best["hours"]:
                    best = row
    return best


def finish(doc: dict, args) -> dict:
    """The projection with the all-reduce model it used and what limits it, per cluster."""
    doc["inputs"].update(allreduce=args.allreduce.describe(args.overlap),
                         allreduce_model=args.allreduce.as_dict())
    doc["limits"] = project_limits.limits(doc)
    return doc


def project(args) -> dict:
    args.allreduce = measured_model(args.measured, args.overlap)
    if args.config:
        return finish(project_recipe(args), args)
    with open(args.study) as f:
        study = json.load(f)
    steps = steps_to_target(study, args.family)
    net = Net(dims=len(args.grid), depth=args.depth)
    profiles = load_profiles(args.profiles)
    out = {}
    for name in args.clusters:
        prof = get_profile(name, profiles)
        out[name] = speedups([best_plan(prof, n, steps, args, net) for n in args.nodes])
    return finish({"inputs": {"study": args.study, "family": args.family, "steps": steps,
                       "nodes": args.nodes,
                       "t_sample": args.t_sample, "t_sample_threads": args.t_sample_threads,
                       "grid": list(args.grid), "params": args.params, "domain": args.domain,
                       "overlap": args.overlap,
                       "measured": "steps to target (the study) and t_sample (this machine)",
                       "modelled": "step times on the clusters (alpha-beta links, Amdahl)"},
                   "projection": out}, args)


def project_recipe(args) -> dict:
    cfg, levels = pr.recipe_levels(args.config, args.set)
    if args.t_sample:
        t_samples = [float(v) for v in args.t_sample.split(",")]
        if len(t_samples) != len(levels):
            raise ValueError(f"--t-sample gives {len(t_samples)} figure(s) for the {len(levels)} "
                             f"level visit(s) of {args.config}: give one per visit, or none to "
                             f"measure them with the probe")
        measured = "steps (the recipe's plan) and t_sample (--t-sample)"
    else:
        t_samples = pr.probe_t_samples(cfg, levels, args.t_sample_threads)
        measured = "t_sample (deepfusion check's probe on this host, one rank)"
    net = pr.recipe_net(cfg, len(levels[0]["grid"]))
    args.params = pr.param_count(net)
    splits = pr.Splits(args.config, args.set, levels, net.depth)
    out, profiles = {}, load_profiles(args.profiles)
    for name in args.clusters:
        prof = get_profile(name, profiles)
        out[name] = speedups([pr.best_recipe_plan(prof, n, levels, t_samples, args, net, splits)
                              for n in args.nodes])
    return {"inputs": {"config": args.config, "set": args.set, "family": args.config,
                       "nodes": args.nodes,
                       "levels": levels, "t_sample": t_samples,
                       "t_sample_threads": args.t_sample_threads, "params": args.params,
                       "overlap": args.overlap, "measured": measured,
                       "modelled": "step times on the clusters (alpha-beta links, Amdahl, halo "
                                   "exchanges); the error reached is the recipe's own"},
            "projection": out}


def speedups(rows: list) -> list:
    """The rows with their speed-up against the first (the fewest nodes) that can run."""
    base = next((r for r in rows if r), None)
    for r in rows:
        if r:
            r["speedup"] = base["hours"] / r["hours"]
    return rows


def table(doc: dict) -> str:
    lines = ["| cluster | nodes | batch | layout (ranks x threads, split) | steps | step s | "
             "hours to target | speed-up |", "|---|---|---|---|---|---|---|---|"]
    for name, rows in doc["projection"].items():
        for nodes, r in zip(doc["inputs"].get("nodes", []) or [None] * len(rows), rows):
            if r is None:
                lines.append(f"| {name} | {nodes} | no layout: the batch cannot spread over "
                             f"this many nodes | | | | | |")
                continue
            split = f", domain {r['domain']}" if r["domain"] else ""
            lines.append(f"| {name} | {r['nodes']} | {r['batch']} ({r['rule']}) | "
                         f"{r['ranks_per_node']} x {r['threads_per_rank']}{split} | {r['steps']} | "
                         f"{r['t_step']:.3g} | {r['hours']:.3g} | {r['speedup']:.1f}x |")
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name, rows in doc["projection"].items():
        rows = [r for r in rows if r]
        ax.plot([r["nodes"] for r in rows], [r["hours"] * 60 for r in rows], marker="o",
                label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("nodes")
    ax.set_ylabel("minutes to the validation target (modelled)")
    ax.set_title(f"{doc['inputs']['family']}: best batch and layout per node count", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser(prog: str = "deepfusion jobs project") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--study", help="a report of lab/tools/batch_study.py (JSON); or --config")
    p.add_argument("--family", help="the study family to project (with --study)")
    p.add_argument("--config", help="project this recipe's own plan at its own batch instead "
                   "of a study's steps (TOML)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="with --config: override a config key (repeatable)")
    p.add_argument("--t-sample", default=None,
                   help="measured seconds per sample (forward + backward) on one rank; with "
                   "--config one per level visit, comma-separated (default: the probe's)")
    p.add_argument("--t-sample-threads", type=int, default=1, help="threads of that rank")
    p.add_argument("--serial-fraction", type=float, default=DEFAULT_SERIAL_FRACTION,
                   help="Amdahl serial fraction of a rank's threads")
    p.add_argument("--grid", type=parse_grid, help="the training grid, HxW (with --study)")
    p.add_argument("--depth", type=int, default=4, help="U-Net depth (domain splits need "
                   "block sides that are multiples of 2**depth)")
    p.add_argument("--params", type=int, default=2_000_000, help="model parameters")
    p.add_argument("--nodes", default="1,4,16,64", help="comma-separated node counts")
    p.add_argument("--clusters", default=DEFAULT_CLUSTERS, help="profiles of deepfusion/jobs/clusters.toml")
    p.add_argument("--profiles", default=None, help="extra profile TOML merged over it")
    p.add_argument("--domain", action="store_true",
                   help="also consider splitting each sample over ranks (parallel.domain)")
    p.add_argument("--overlap", action="store_true",
                   help="model the gradient all-reduce overlapped with the backward pass "
                   "(parallel.overlap = true): hidden behind 2/3 of the compute, a bound, "
                   "unless --measured measures it")
    p.add_argument("--measured", action="append", default=[], metavar="RUN_OR_JSON",
                   help="take the overlap and the arrival skew of the gradient all-reduce from "
                   "a measurement: a run directory (its metrics.jsonl's allreduce_* fields, 2+ "
                   "ranks) or a bench JSON (make bench's bench.json); repeatable, e.g. a run "
                   "with and one without parallel.overlap")
    p.add_argument("--combine", nargs="+", metavar="PROJECT_JSON",
                   help="instead of projecting: put these project.json files side by side "
                   "(summary.md, summary.png in --out)")
    p.add_argument("--out", required=True, help="output directory (project.json, project.md, "
                   "project.png)")
    return p


def check_args(args) -> None:
    """ValueError naming what is missing or wrong in the command line."""
    if min(args.nodes) < 1:
        raise ValueError("--nodes must be >= 1")
    if args.config:
        if args.study or args.family:
            raise ValueError("give either --config (a recipe's own plan) or --study and "
                             "--family (a batch study's steps), not both")
        return
    missing = [o for o, v in (("--study", args.study), ("--family", args.family),
                              ("--grid", args.grid), ("--t-sample", args.t_sample)) if not v]
    if missing:
        raise ValueError(f"with a batch study, {', '.join(missing)} must be given (or project a "
                         f"recipe's own plan with --config)")
    args.t_sample = float(args.t_sample)
    if args.t_sample <= 0:
        raise ValueError("--t-sample must be > 0")


def combine_main(args) -> int:
    try:
        text = combine(args.combine, Path(args.out))
    except (ValueError, OSError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(text)
    print(f"-> {args.out}/summary.md, summary.png (the projections' own figures)")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_output_dir(args.out, flag="--out")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.combine:
        return combine_main(args)
    try:
        args.nodes = [int(n) for n in args.nodes.split(",") if n.strip()]
        args.clusters = [c.strip() for c in args.clusters.split(",") if c.strip()]
        check_args(args)
        doc = project(args)
    except (ValueError, OSError, KeyError, InputError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "project.json").write_text(json.dumps(doc, indent=1))
    text = "\n".join([table(doc), "", *project_limits.lines(doc)])
    (out / "project.md").write_text(text + "\n")
    plot(doc, out / "project.png")
    print(text)
    print(f"-> {out}/project.json, project.md, project.png (modelled step times; measured steps "
          f"and t_sample{', and the all-reduce' if args.measured else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
