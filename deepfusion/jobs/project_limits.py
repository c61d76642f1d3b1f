"""What limits a projection's speed-up at a node count (``deepfusion jobs project``, 16 nodes by
default): the share of the modelled time each part of a step takes on the layout chosen, and
the part that stops it short of the goal (10x).

Parts (seconds of the whole run, from the same sums as its time): ``compute`` (forward and
backward on each rank's share of the batch and of its sample, Amdahl over its threads),
``halo`` (the exchanges of a split sample: ghost layers, norm sums, the whole-field gathers of a
grown network), ``allreduce`` (the gradient all-reduce the step waits for) and ``skew`` (the
measured arrival skew, with ``--measured``). With ``speedup_if_free`` the speed-up if every
exchange cost nothing:

* below the goal even then: **compute** limits it (the batch and the splits leave each rank
  too much work, or Amdahl leaves its threads idle): more nodes need more work per step;
* else the largest of halo, all-reduce and skew.
"""
from __future__ import annotations

PARTS = ("compute", "halo", "allreduce", "skew")
GOAL = 10.0
WHY = {"compute": "compute: the batch and the splits leave each rank too much work (or Amdahl "
                  "its threads idle)",
       "halo": "the halo exchanges of the split samples",
       "allreduce": "the gradient all-reduce",
       "skew": "the ranks' arrival skew at the all-reduce"}


def shares(seconds: dict) -> dict:
    """{part: share of the total} of {part: seconds}."""
    total = sum(seconds.values())
    return {k: (seconds.get(k, 0.0) / total if total > 0 else 0.0) for k in PARTS}


def limit(rows: list, nodes: list, at: int, goal: float = GOAL) -> dict:
    """What limits the speed-up of ``rows`` (one per node count of ``nodes``) at ``at`` nodes."""
    by_nodes = dict(zip(nodes, rows))
    base = next((r for r in rows if r), None)
    row = by_nodes.get(at)
    if row is None or base is None:
        return {"nodes": at, "speedup": None, "limited_by": "no layout",
                "text": f"{at} nodes: no layout (the plan cannot spread over so many nodes)"}
    parts = row["parts"]
    free = base["hours"] / (row["hours"] * parts["compute"]) if parts["compute"] > 0 else None
    comm = {k: parts[k] for k in PARTS[1:]}
    if row["speedup"] >= goal:
        by = None
    elif free is not None and free < goal:
        by = "compute"
    else:
        by = max(comm, key=comm.get)
    share_text = ", ".join(f"{k} {parts[k]:.0%}" for k in PARTS if parts[k] >= 0.005)
    free_text = f"; with free exchanges {free:.1f}x" if free is not None else ""
    head = f"{at} nodes: {row['speedup']:.1f}x ({share_text}{free_text})"
    text = f"{head}: reaches {goal:g}x" if by is None else f"{head}: limited by {WHY[by]}"
    return {"nodes": at, "speedup": row["speedup"], "speedup_if_free": free, "shares": parts,
            "limited_by": by, "text": text}


def limits(doc: dict, at: int | None = None) -> dict:
    """{cluster: :func:`limit`} at ``at`` nodes (default: 16 if projected, else the most)."""
    nodes = doc["inputs"].get("nodes", [])
    if at is None:
        at = 16 if 16 in nodes else max(nodes)
    return {name: limit(rows, nodes, at) for name, rows in doc["projection"].items()}


def lines(doc: dict) -> list[str]:
    """The output's lines: the all-reduce model used, then what limits each cluster."""
    out = [doc["inputs"]["allreduce"]]
    for name, lim in doc.get("limits", {}).items():
        out.append(f"{name} at {lim['text']}")
    return out
