"""The fastest measured ranks x threads layout of a sweep: what ``jobs render --layout-from``
puts in the job script instead of the profile's default layout.

Which of P = 2 x 1 and P = 1 x 2 is faster depends on the CPU, the grid and the batch (even
two runs of the same comparison on one machine can disagree: lab/notes/readme-second-release.md,
"Performance"), so the choice is measured on the node the job will run on (``deepfusion jobs
sweep --mode strong``) and read from its sweep.json here, never guessed.
"""
from __future__ import annotations

import json
import os


def load_sweep(sweep_json: str | os.PathLike) -> dict:
    """A sweep.json as ``jobs sweep`` writes it; ValueError names the file and the fix."""
    try:
        with open(sweep_json) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--layout-from {sweep_json}: cannot read a sweep.json ({exc}); "
                         f"write one with deepfusion jobs sweep --out DIR") from None


def fastest_layout(doc: dict, source: str | os.PathLike) -> tuple[int, int, str]:
    """(ranks per node, threads per rank, a line saying what was measured) of the one-node
    layout with the most samples/s in a strong-scaling sweep ``doc`` (read from ``source``);
    ties go to fewer ranks. ValueError names the file and what is wrong with it."""
    mode = doc.get("meta", {}).get("mode")
    if mode != "strong":
        raise ValueError(f"--layout-from {source}: a {mode or 'unknown'}-scaling sweep compares "
                         f"different global batches; layouts are compared at a fixed global "
                         f"batch: run deepfusion jobs sweep --mode strong")
    rows = [r for r in doc.get("layouts", []) if r.get("nodes", 1) == 1
            and r.get("status") == "ok" and (r.get("samples_per_s") or 0) > 0]
    if not rows:
        raise ValueError(f"--layout-from {source}: no one-node layout finished with a "
                         f"measured step time; rerun the sweep")
    best = max(rows, key=lambda r: (r["samples_per_s"], -r["ranks"]))
    others = ", ".join(f"{r['ranks']}x{r['threads']} {r['samples_per_s']:.1f}"
                       for r in rows if r is not best)
    line = (f"layout from {source}: {best['ranks']}x{best['threads']} (ranks x threads), "
            f"{best['samples_per_s']:.1f} samples/s at global batch {best['global_batch']}"
            + (f"; measured against {others}" if others else ""))
    return int(best["ranks"]), int(best["threads"]), line


def host_note(doc: dict, source: str | os.PathLike, cores_per_node) -> str | None:
    """A warning when the sweep ``doc`` ran on a host with another core count than the
    profile's nodes (its choice may not hold there); None when they match or either is unknown."""
    cores = doc.get("meta", {}).get("host_cores")
    if isinstance(cores_per_node, int) and isinstance(cores, int) and cores != cores_per_node:
        return (f"the sweep in {source} ran on a host with {cores} cores, the profile's "
                f"nodes have {cores_per_node}: measure on one of them (deepfusion jobs sweep "
                f"--cluster NAME) for a choice that holds there")
    return None
