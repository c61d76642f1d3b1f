"""Seconds per sample of the exact Burgers reference (Lax-Oleinik), lower-hull vs brute-force search.

    OMP_NUM_THREADS=1 python -m lab.tools.burgers_exact_bench [--sizes 256,512,1024]
        [--methods hull,brute] [--samples 3] [--brute-max 512] [--out FILE]

What it measures: for each N in ``--sizes``, the wall and process-CPU seconds of one N x N
(t_nodes = x_nodes = N) solve of ``solve_burgers_exact`` with the Burgers problem's initial
condition 0.5 (1 - cos(2 pi c x)), t_end = 1/3 and the default oversample 64 -- exactly the call
``Burgers(grid=(N, N)).reference_solution([c])`` makes -- for ``--samples`` draws of c uniform
in [3, 6] (the problem's default c_range; seed 0, the same draws for every method). "hull" is the
default search, "brute" the O(N^3) brute force kept for checking (the search of the code before
the hull; runs only up to ``--brute-max`` because it takes minutes at 1024). Reported per
method: the median, min and max seconds per sample (wall and CPU) and, where both methods ran,
the largest |hull - brute| and the number of nodes differing by more than 1e-12 (shock nodes
where the two minima tie within round-off). One process, single-threaded numpy; prints JSON.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from bench.common import Timer, emit_json, load  # noqa: E402
from diffnet.reference import solve_burgers_exact  # noqa: E402

T_END = 1.0 / 3.0                  # diffnet.problems.families.burgers.T_END (not imported: no torch)


def initial_condition(c: float, x: np.ndarray) -> np.ndarray:
    """diffnet.problems.families.burgers.initial_condition: u0(x) = 0.5 (1 - cos(2 pi c x))."""
    return 0.5 * (1.0 - np.cos(2.0 * np.pi * c * x))


def _stats(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4)}


def run(sizes, methods, samples: int, brute_max: int) -> dict:
    cs = np.random.default_rng(0).uniform(3.0, 6.0, size=samples)
    res = {"what": "seconds per N x N sample of solve_burgers_exact (Burgers u0, t_end 1/3, "
                   "oversample 64)", "c": [round(float(c), 6) for c in cs],
           "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "loadavg_start": load(),
           "numpy": np.__version__, "sizes": {}}
    for n in sizes:
        row, sols = {}, {}
        for method in methods:
            if method == "brute" and n > brute_max:
                continue
            wall, cpu = [], []
            for c in cs:
                with Timer() as tm:
                    u = solve_burgers_exact(lambda x, c=c: initial_condition(c, x), x_nodes=n,
                                            t_nodes=n, t_end=T_END, method=method)
                wall.append(tm.wall)
                cpu.append(tm.cpu)
                sols.setdefault(method, []).append(u)
            row[method] = {"wall_s": _stats(wall), "cpu_s": _stats(cpu)}
            print(f"N={n} {method}: {row[method]}", file=sys.stderr, flush=True)
        if len(sols) == 2:
            diffs = [np.abs(a - b) for a, b in zip(sols["hull"], sols["brute"])]
            row["max_abs_diff"] = float(max(d.max() for d in diffs))
            row["tie_nodes"] = [int((d > 1e-12).sum()) for d in diffs]
            row["speedup_cpu"] = round(row["brute"]["cpu_s"]["median"]
                                       / row["hull"]["cpu_s"]["median"], 1)
        res["sizes"][str(n)] = row
    res["loadavg_end"] = load()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="256,512,1024")
    ap.add_argument("--methods", default="hull,brute")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--brute-max", type=int, default=512)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    emit_json(run(sizes, methods, args.samples, args.brute_max), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
