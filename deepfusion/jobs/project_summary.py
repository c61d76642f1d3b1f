"""Several projections side by side: ``deepfusion jobs project --combine A/project.json
B/project.json ... --out DIR`` writes ``summary.md`` (per projection and cluster: the time on
the fewest nodes and the speed-up at each node count, with the layout chosen; then what limits
each at 16 nodes, :mod:`deepfusion.jobs.project_limits`) and ``summary.png`` (minutes to the
target against nodes, one line per projection and cluster).

Nothing is projected anew: the figures are those of the ``project.json`` files, which say what
in them is measured and what is modelled.
"""
from __future__ import annotations

import json
from pathlib import Path

from deepfusion.jobs import project_limits


def load(paths: list[str]) -> list[dict]:
    """The projections, each with its ``name``: the directory of its project.json (else the
    recipe's or study family's file stem), marked when the all-reduce was overlapped and when
    it was modelled from a measurement (``--measured``)."""
    docs = []
    for p in paths:
        with open(p) as f:
            doc = json.load(f)
        if "projection" not in doc or "inputs" not in doc:
            raise ValueError(f"{p} is not a project.json of deepfusion jobs project (no "
                             f"'projection' or 'inputs'): give the project.json files it wrote")
        # the directory it was written to names it: two projections of one recipe (other
        # --set or --overlap) are told apart by their --out
        doc["name"] = (Path(p).parent.name if Path(p).name == "project.json" and
                       Path(p).parent.name else Path(str(doc["inputs"].get("family") or p)).stem)
        if doc["inputs"].get("overlap"):
            doc["name"] += " (overlap)"
        if doc["inputs"].get("allreduce_model", {}).get("sources"):
            doc["name"] += " (measured all-reduce)"
        docs.append(doc)
    return docs


def layout(r: dict) -> str:
    split = "x".join(map(str, r["domain"])) + " split" if r.get("domain") else "no split"
    return f"{r['ranks']} ranks ({r['ranks_per_node']}/node x {r['threads_per_rank']} thr), {split}"


def summary_table(docs: list[dict]) -> str:
    """One row per projection and cluster: minutes on the first node count that runs, then
    the speed-up and layout at every node count."""
    nodes = sorted({n for d in docs for n in d["inputs"].get("nodes", [])})
    head = ["projection", "cluster", "minutes on the fewest nodes"] + [f"{n} nodes" for n in nodes]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d in docs:
        for cluster, rows in d["projection"].items():
            by_nodes = dict(zip(d["inputs"].get("nodes", []), rows))
            first = next((r for r in rows if r), None)
            cells = [f"`{d['name']}`", cluster,
                     f"{first['hours'] * 60:.3g} ({first['nodes']} node(s))" if first else "-"]
            for n in nodes:
                r = by_nodes.get(n)
                cells.append(f"{r['speedup']:.1f}x: {layout(r)}" if r else "no layout")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def limits_table(docs: list[dict]) -> str:
    """One row per projection and cluster: the speed-up at the node count its limits were taken
    at (16 if projected), each part's share of the run there, the speed-up if every exchange
    were free, and what limits it (``limits`` of project.json)."""
    parts = project_limits.PARTS
    head = ["projection", "cluster", "nodes", "speed-up", *parts, "with free exchanges",
            "limited by"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d in docs:
        for cluster, lim in d.get("limits", {}).items():
            if lim.get("speedup") is None:
                cells = ["-"] * (len(parts) + 2) + ["no layout"]
            else:
                free = lim.get("speedup_if_free")
                cells = [f"{lim['speedup']:.1f}x",
                         *(f"{lim['shares'].get(k, 0.0):.0%}" for k in parts),
                         f"{free:.1f}x" if free is not None else "-",
                         lim["limited_by"] or "reaches the goal"]
            lines.append("| " + " | ".join([f"`{d['name']}`", cluster, str(lim["nodes"]),
                                            *cells]) + " |")
    return "\n".join(lines)


def summary_plot(docs: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.0, 4.4))
    styles = ["-", "--", ":", "-."]
    for i, d in enumerate(docs):
        for j, (cluster, rows) in enumerate(d["projection"].items()):
            rows = [r for r in rows if r]
            ax.plot([r["nodes"] for r in rows], [r["hours"] * 60 for r in rows],
                    linestyle=styles[j % len(styles)], marker="o", color=f"C{i}",
                    label=f"{d['name']} on {cluster}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("nodes")
    ax.set_ylabel("minutes to the target (modelled step times)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def combine(paths: list[str], out: Path) -> str:
    """Write summary.md and summary.png of the projections at ``paths`` into ``out``."""
    docs = load(paths)
    out.mkdir(parents=True, exist_ok=True)
    text = summary_table(docs)
    if any(d.get("limits") for d in docs):
        text += "\n\n" + limits_table(docs)
    (out / "summary.md").write_text(text + "\n")
    summary_plot(docs, out / "summary.png")
    return text
