"""Steps timed in alternated rounds in one process (the order flipped every round), so that two
variants of a step see the same shared host: their difference is often smaller than the
host's drift between two runs."""
from __future__ import annotations

import statistics
import time


def alternate(steps: dict, rounds: int, phases: tuple[str, ...] = ()) -> dict:
    """{name: {"step": [s per round], phase: [...]}} for the callables ``steps`` (each warmed
    twice first); a phase is read from the step's ``times`` after each call."""
    times = {k: {p: [] for p in ("step",) + phases} for k in steps}
    for step in steps.values():
        step(), step()
    for r in range(rounds):
        for k in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            t0 = time.perf_counter()
            steps[k]()
            times[k]["step"].append(time.perf_counter() - t0)
            for p in phases:
                times[k][p].append(steps[k].times[p])
    return times


def medians(times: dict) -> dict:
    return {k: {p: statistics.median(v) for p, v in t.items()} for k, t in times.items()}


def faster_rounds(times: dict, slow: str, fast: str, phase: str = "step") -> int:
    """In how many rounds ``fast`` took less time than ``slow``."""
    return sum(a > b for a, b in zip(times[slow][phase], times[fast][phase]))


def ab_main(argv, doc: str, measure, line, rounds: int) -> int:
    """The command line of an A/B tool: ``--grids``, ``--threads``, ``--rounds``, ``--out``;
    ``measure(grid, batch, threads, rounds)`` per configuration, as ``deepfusion train`` runs
    (freed memory kept), ``line(run)`` printed for each, the runs written to ``--out``."""
    import argparse
    import json

    from bench.step_bench import parse_grids, parse_threads
    from deepfusion.engine.parallel.memory import reuse_freed_memory

    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--grids", default="64:16,256:2")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--out")
    a = p.parse_args(argv)
    reuse_freed_memory(True)
    runs = []
    for t in parse_threads(a.threads):
        for g, b in parse_grids(a.grids):
            runs.append(measure(g, b, t, a.rounds))
            print(line(runs[-1]), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"runs": runs}, f, indent=1)
    return 0
