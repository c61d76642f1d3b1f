"""The floor of Burgers' finite-volume residual losses: each scheme's own zero, marched, against
the exact entropy solution, on the test draws, per grid.

    python -m lab.tools.scheme_floor [--grids 64,256,512] [--schemes upwind,muscl:mc,muscl:superbee]
                                 [--draws 64] [--seed 271828] [--c-range 3,6] [--out FILE.json]

A residual loss ("upwind", "muscl": ``Burgers(scheme=...)``) is zero exactly on the field the
scheme marches from u0 (row 0) with the inflow value 0 at x = 0 (``hard_bc = true``): every
k-step residual (u[i] - Phi^k(u[i-k])) / (k dt) vanishes there. A network trained on that loss
approaches this field, so its relative L2 distance to the exact solution (the reference
``deepfusion evaluate`` scores against) is the best the route can reach on that grid, whatever
the training. The scheme here is the problem's own ``step`` (the one the loss applies). The
draws are ``sample_params(seed, range(draws))``; seed 271828 is ``data.test_seed``'s default,
so these are the draws ``deepfusion evaluate`` tests on.

``cells`` (not a loss) is the exact solution's own cell averages
(``diffnet.reference.exact_cell_averages``): the field a perfect conservative finite-volume
method would hold on the grid, scored against the nodal solution as every route is. It says how
close any finite-volume answer can come on that grid, however sharp its scheme.

Prints one summary line per (grid, scheme) (mean / median / worst) and writes the JSON (per-draw
errors too) to ``--out`` (default bench/out/scheme_floor.json).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

from bench.common import ROOT, command_line, emit_json, load

CELLS = "cells"  # the exact cell averages: not a loss, the best any finite-volume field can be


def parse_scheme(text: str) -> tuple[str, str]:
    """"muscl:mc" -> ("muscl", "mc"); "upwind" -> ("upwind", "mc") (the limiter is unused)."""
    scheme, _, limiter = text.partition(":")
    return scheme, limiter or "mc"


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m lab.tools.scheme_floor",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--grids", default="64,256,512", help="N of the N x N grids, comma-separated")
    ap.add_argument("--schemes", default="upwind,muscl:mc,muscl:superbee",
                    help="scheme[:limiter], comma-separated (schemes: upwind, muscl; cells: the "
                         "exact cell averages)")
    ap.add_argument("--draws", type=int, default=64)
    ap.add_argument("--seed", type=int, default=271828)
    ap.add_argument("--c-range", default="3,6", help="the problem's c_range, lo,hi")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    try:
        args.grids = [int(g) for g in args.grids.split(",")]
        args.c_range = tuple(float(c) for c in args.c_range.split(","))
    except ValueError as e:
        ap.error(f"--grids / --c-range must be comma-separated numbers ({e})")
    args.command = command_line(ap.prog, argv)
    from diffnet.problems.families.burgers_fv import FV_SCHEMES

    args.schemes = [parse_scheme(s) for s in args.schemes.split(",")]
    bad = [s for s, _ in args.schemes if s not in FV_SCHEMES + (CELLS,)]
    if bad:
        ap.error(f"--schemes: {bad} are not finite-volume schemes; valid: "
                 f"{', '.join(FV_SCHEMES + (CELLS,))} (muscl[:limiter])")
    if args.draws < 1 or min(args.grids) < 3 or len(args.c_range) != 2:
        ap.error("need --draws >= 1, every grid >= 3 and --c-range lo,hi")
    return args


def cell_fields(grid: int, params: np.ndarray):
    """(n, H, W) float64: the exact entropy solution's averages over each node's cell."""
    from diffnet.problems.families.burgers import T_END, initial_condition
    from diffnet.reference import exact_cell_averages

    return np.stack([exact_cell_averages(lambda x, c=float(p[0]): initial_condition(c, x),
                                         x_nodes=grid, t_nodes=grid, t_end=T_END)
                     for p in params])


def march(problem, params: np.ndarray):
    """(n, H, W) float64: the scheme's zero, u0 on row 0 (0 at x = 0), each row the problem's
    ``step`` of the one before."""
    import torch

    v = problem.build_input(params, dtype=torch.float64)[:, 0, 0, :].clone()
    v[:, 0] = 0.0
    rows = [v]
    for _ in range(problem.grid[0] - 1):
        rows.append(problem.step(rows[-1]))
    return torch.stack(rows, dim=1).numpy()


def floors(grid: int, schemes, args) -> list[dict]:
    """One result per scheme on the N x N grid, all against one set of exact solutions."""
    from diffnet.metrics import relative_l2
    from diffnet.problems import get_problem

    def burgers(scheme="lax-oleinik", limiter="mc"):
        return get_problem("burgers", grid=(grid, grid), c_range=args.c_range, hard_bc=True,
                           scheme=scheme, limiter=limiter)

    exact = burgers()
    params = exact.sample_params(args.seed, range(args.draws))
    t0 = time.perf_counter()
    refs = np.stack([exact.reference_solution(p) for p in params])
    print(f"{grid}x{grid}: {args.draws} exact solutions in {time.perf_counter() - t0:.1f} s",
          flush=True)
    out = []
    for scheme, limiter in schemes:
        t0 = time.perf_counter()
        fields = (cell_fields(grid, params) if scheme == CELLS
                  else march(burgers(scheme, limiter), params))
        errs = [float(e) for e in relative_l2(fields, refs)]
        name = scheme if scheme in ("upwind", CELLS) else f"{scheme}:{limiter}"
        out.append({"grid": [grid, grid], "scheme": name, "rel_l2_mean": float(np.mean(errs)),
                    "rel_l2_median": float(statistics.median(errs)),
                    "rel_l2_worst": max(errs), "march_s": round(time.perf_counter() - t0, 2),
                    "rel_l2": errs})
        r = out[-1]
        print(f"{grid}x{grid} {name:15s} floor: mean {r['rel_l2_mean']:.2%}, median "
              f"{r['rel_l2_median']:.2%}, worst {r['rel_l2_worst']:.2%}", flush=True)
    return out


def main(argv=None) -> int:
    args = parse(argv)
    rows = [r for g in args.grids for r in floors(g, args.schemes, args)]
    res = {"command": args.command,
           "c_range": list(args.c_range), "seed": args.seed, "draws": args.draws,
           "reference": "exact", "loadavg_end": load(), "rows": rows}
    emit_json(res, args.out or os.path.join(ROOT, "bench", "out", "scheme_floor.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
