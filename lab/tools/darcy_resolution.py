"""Does a Darcy family need the fine grid? The coarse reference interpolated vs the fine one.

    python -m lab.tools.darcy_resolution --family benchmark --draws 64 --seed 271828
    python -m lab.tools.darcy_resolution --family fine-scale --draws 64 --seed 271828
        [--coarse 64] [--fine 512] [--tau T] [--alpha A] [--a-hi H] [--a-lo L]
        [--coefficient threshold|lognormal] [--modes M] [--method auto|direct|amg]
        [--out FILE.json]

For each draw (``sample_params(seed, range(draws))``; seed 271828 is ``data.test_seed``'s default,
so these are the draws ``deepfusion evaluate`` tests on) the same coefficient field -- one
parameter vector of spectral coefficients -- is rendered on the coarse and on the fine node grid,
both are solved by the reference finite-volume solver, and the coarse solution, interpolated to
the fine grid (``diffnet.resample.resample_nodes``: bilinear on nodes, as ``deepfusion infer
--work-grid`` transfers resolution), is compared with the fine one: relative L2 over the fine
nodes. A network trained on the coarse grid cannot beat this number by interpolating its output;
when it is well under the target accuracy the family does not need the fine grid.

Prints one line per draw and a summary (mean / median / worst); writes the JSON (config, per-draw
errors, solver seconds) to ``--out`` (default bench/out/darcy_resolution_<family>.json).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

from bench.common import ROOT, command_line, emit_json, load


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m lab.tools.darcy_resolution",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="benchmark", help="benchmark | fine-scale")
    ap.add_argument("--draws", type=int, default=64)
    ap.add_argument("--seed", type=int, default=271828)
    ap.add_argument("--coarse", type=int, default=64, help="coarse grid: N x N nodes")
    ap.add_argument("--fine", type=int, default=512, help="fine grid: N x N nodes")
    ap.add_argument("--tau", type=float)
    ap.add_argument("--alpha", type=float)
    ap.add_argument("--a-hi", type=float, dest="a_hi")
    ap.add_argument("--a-lo", type=float, dest="a_lo")
    ap.add_argument("--coefficient", default="threshold")
    ap.add_argument("--modes", type=int, default=32)
    ap.add_argument("--method", default="auto", help="reference solver: auto | direct | amg")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.draws < 1:
        ap.error(f"--draws must be >= 1, got {args.draws}")
    if not 3 <= args.coarse <= args.fine:
        ap.error(f"need 3 <= --coarse <= --fine, got {args.coarse}, {args.fine}")
    args.command = command_line(ap.prog, argv)
    return args


def darcy_options(args) -> dict:
    opts = {"family": args.family, "coefficient": args.coefficient, "modes": args.modes}
    opts.update({k: getattr(args, k) for k in ("tau", "alpha", "a_hi", "a_lo")
                 if getattr(args, k) is not None})
    return opts


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def measure(args) -> dict:
    import torch

    from diffnet.problems import get_problem
    from diffnet.resample import resample_nodes

    opts = darcy_options(args)
    coarse = get_problem("darcy", grid=(args.coarse,) * 2, **opts)
    fine = get_problem("darcy", grid=(args.fine,) * 2, **opts)
    params = fine.sample_params(args.seed, range(args.draws))
    rows = []
    t_start = time.perf_counter()
    for j, p in enumerate(params):
        t0 = time.perf_counter()
        uc = coarse.reference_solution(p, args.method)
        t1 = time.perf_counter()
        uf = fine.reference_solution(p, args.method)
        t2 = time.perf_counter()
        up = resample_nodes(torch.from_numpy(uc)[None, None], fine.grid)[0, 0].numpy()
        a = fine.nu_nodes(p)
        rows.append({"draw": j, "rel_l2": rel_l2(up, uf),
                     "fraction_a_hi": (float(np.mean(a == fine.a_hi))
                                       if fine.coefficient == "threshold" else None),
                     "coarse_s": round(t1 - t0, 4), "fine_s": round(t2 - t1, 4)})
        print(f"draw {j:3d}: rel L2 {rows[-1]['rel_l2']:.4%}  (solves {t1 - t0:.2f} s + "
              f"{t2 - t1:.2f} s)", flush=True)
    errs = [r["rel_l2"] for r in rows]
    worst = int(np.argmax(errs))
    return {
        "command": args.command,
        "problem": fine.config(), "coarse_grid": list(coarse.grid), "fine_grid": list(fine.grid),
        "seed": args.seed, "draws": args.draws, "method": args.method,
        "rel_l2_mean": float(np.mean(errs)), "rel_l2_median": float(statistics.median(errs)),
        "rel_l2_worst": errs[worst], "worst_draw": worst,
        "rel_l2_min": float(np.min(errs)),
        "seconds_total": round(time.perf_counter() - t_start, 2),
        "fine_solve_s_median": float(statistics.median(r["fine_s"] for r in rows)),
        "loadavg_end": load(), "rows": rows,
    }


def main(argv=None) -> int:
    args = parse(argv)
    res = measure(args)
    c = res["problem"]
    values = (f"a {c['a_hi']:g}/{c['a_lo']:g}" if c["coefficient"] == "threshold"
              else "a = exp(mu)")
    print(f"\n{args.family} (tau {c['tau']:g}, alpha {c['alpha']:g}, {values}, {c['modes']} "
          f"modes):\n  {args.coarse}x{args.coarse} reference "
          f"interpolated to {args.fine}x{args.fine} vs the {args.fine}x{args.fine} reference, "
          f"{args.draws} draws of seed {args.seed}: mean {res['rel_l2_mean']:.2%}, median "
          f"{res['rel_l2_median']:.2%}, worst {res['rel_l2_worst']:.2%} (draw "
          f"{res['worst_draw']}), best {res['rel_l2_min']:.2%}; {res['seconds_total']:.0f} s")
    out = args.out or os.path.join(ROOT, "bench", "out", f"darcy_resolution_{args.family}.json")
    emit_json(res, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
