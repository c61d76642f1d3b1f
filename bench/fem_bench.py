"""The classical solvers of a diffusion problem at the native grid: sparse direct vs AMG.

    python -m bench.fem_bench --sizes 512,1024 --samples 4 --family fine-scale
                              --rtols 1e-8,1e-4,1e-2 --threads 1 --out bench/out/fem_darcy.json
                              [--seed 271828] [--maxiter 1000] [--export DIR]
    python -m bench.fem_bench --problem poisson3d --sizes 128 --samples 2 --seed 777
                              --reference amg --rtols 1e-10,1e-1 --out bench/out/fem_poisson3d.json

The reference side of "inference against FEM at the native grid". For each grid size N (N x N
nodes) and each of S draws (``sample_params(seed, range(S))`` of ``get_problem("darcy",
grid=(N, N), family=...)``; seed 271828 is ``data.test_seed``'s default, the draws ``deepfusion
evaluate`` tests on; ``--problem`` names another problem whose input channel 0 is nu, 2-D or
3-D, on an N x N (x N) grid) the linear system is assembled exactly as ``reference_solution``
assembles it (``assemble_diffusion``, 2-D or 3-D, with the problem's lengths and
``diffusion_options``: harmonic face means, the problem's source and Dirichlet values, Dirichlet
nodes eliminated), timed apart, and solved by

* direct: SuperLU (``solve_direct``, the reference "direct" solver); setup = factorisation,
  solve = triangular solves. Its solution is what every error below is measured against. With
  ``--reference amg`` (3-D grids, where SuperLU's fill-in does not fit) the reference is instead
  AMG-CG to a relative residual of 1e-12 (row ``amg_reference``).
* amg: pyamg smoothed aggregation (``amg_hierarchy``, the reference settings) as the V-cycle
  preconditioner of CG (``amg_cg``), for each relative residual tolerance of ``--rtols``: setup
  (the hierarchy: built once per draw, shared by the tolerances) and solve seconds apart, CG
  iterations, relative L2 error against the reference over all nodes (boundary included, as
  the project's field errors are computed).
* amg_reused: draw 0's hierarchy as the preconditioner of CG on draws 1..S-1 (one sparsity
  pattern per grid, other values), so the setup is paid once per grid (its setup_s is draw 0's
  hierarchy). Valid: a symmetric V-cycle of an SPD matrix is an SPD preconditioner, which is all
  CG needs for another SPD matrix; but the more a draw's coefficient differs from draw 0's, the
  worse it preconditions and the more iterations it takes (capped by ``--maxiter``: a row
  records the residual reached and ``converged`` false, it does not fail): on a high-contrast
  family such as "fine-scale" CG can take many times the iterations it takes with the draw's
  own setup.

Times are wall seconds per sample, medians over the draws (iterations and errors: median and
max); total_s = setup + solve (amg_reused: draw 0's setup shared by the S draws, setup / S +
solve). An untimed warm-up on a 16x16 grid loads the code first. Memory: the process's peak RSS
(VmHWM) after each grid and at the end; one process runs the grids in the given order, so a
grid's value includes the earlier grids' peak (run one size per process for a per-size peak).
``--threads`` sets the BLAS / OpenMP threads (environment, before numpy loads) and torch's.

Prints one line per configuration (N, method, tol, setup s, solve s per sample, iterations, rel
L2 vs the reference); writes the JSON (``emit_json``) to ``--out`` (default
bench/out/fem_darcy.json).

``--export DIR`` also writes each draw's system and reference solution to ``DIR/N{N}_draw{i}.npz``
(``export_system``), for solvers outside this environment: ``bench/hypre_bench.py`` solves them
with hypre's BoomerAMG through petsc4py.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from bench.common import ROOT, command_line, emit_json, load, machine, peak_rss_mb

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# numpy is imported inside the functions: the BLAS reads its thread count when numpy loads,
# which must come after set_threads.


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m bench.fem_bench",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="512,1024", help="grid sizes N (N x N nodes), comma list")
    ap.add_argument("--samples", type=int, default=4, help="draws S per grid")
    ap.add_argument("--problem", default="darcy", help="a diffusion problem: darcy, poisson, "
                    "reaction_diffusion, poisson3d")
    ap.add_argument("--family", default="fine-scale", help="darcy's family: benchmark | fine-scale")
    ap.add_argument("--reference", default="direct", choices=("direct", "amg"),
                    help="what errors are measured against: SuperLU, or AMG-CG to 1e-12 (3-D)")
    ap.add_argument("--seed", type=int, default=271828)
    ap.add_argument("--rtols", default="1e-8,1e-4,1e-2", help="AMG-CG relative residuals")
    ap.add_argument("--maxiter", type=int, default=1000, help="CG iteration cap")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "fem_darcy.json"))
    ap.add_argument("--export", default=None, metavar="DIR",
                    help="also write each draw's system and reference solution to DIR (npz)")
    args = ap.parse_args(argv)
    args.command = command_line(ap.prog, argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.rtols = [float(r) for r in args.rtols.split(",")]
    if min(args.sizes) < 3 or args.samples < 1 or args.maxiter < 1 or args.threads < 1:
        ap.error("need --sizes >= 3, --samples >= 1, --maxiter >= 1, --threads >= 1")
    if not all(0 < r < 1 for r in args.rtols):
        ap.error(f"--rtols must lie in (0, 1), got {args.rtols}")
    return args


def set_threads(n: int) -> bool:
    """BLAS / OpenMP / torch threads; True when numpy was not loaded yet (the env counts)."""
    for var in THREAD_VARS:
        os.environ[var] = str(n)
    fresh = "numpy" not in sys.modules
    import torch

    torch.set_num_threads(n)
    return fresh


def draw_nu(p, params, i: int):
    """(N, N) float64 a at the nodes of draw i: channel 0 ("nu") of the network's input."""
    import torch

    return p.build_input(params[i:i + 1], dtype=torch.float64)[0, 0].numpy()


def assemble(p, nu):
    """The reference solver's system of ``nu`` (as ``solve_nu`` calls ``solve_diffusion``)."""
    from diffnet.reference import assemble_diffusion

    lengths = tuple(ax.hi - ax.lo for ax in p.axes)
    return assemble_diffusion(nu, lengths=lengths, **p.diffusion_options())


def check_problem(name: str) -> None:
    """Exit (status 2) unless ``name`` is a diffusion problem; after ``set_threads``, since
    the problems import torch and numpy."""
    from diffnet.problems import PROBLEMS

    valid = [n for n, c in PROBLEMS.items() if hasattr(c, "diffusion_options")]
    if name not in valid:
        print(f"python -m bench.fem_bench: error: --problem {name!r}: it solves diffusion "
              f"problems; choose from {', '.join(valid)}", file=sys.stderr)
        sys.exit(2)


def get_dims(name: str) -> int:
    from diffnet.problems import PROBLEMS

    return PROBLEMS[name].dims


def make_problem(n: int, args):
    """The problem on the N x N (x N) grid: ``--family`` goes to darcy alone."""
    from diffnet.problems import get_problem

    dims = get_dims(args.problem)
    options = {"family": args.family} if args.problem == "darcy" else {}
    return get_problem(args.problem, grid=(n,) * dims, **options)


def field(x, free, u_full):
    u = u_full.copy()
    u[free] = x
    return u


def rel_l2(u, ref) -> float:
    import numpy as np

    return float(np.linalg.norm(u - ref) / np.linalg.norm(ref))


def cg_records(ml, system, u_ref, rtols, maxiter, setup_s) -> dict:
    """{rtol: record} of CG preconditioned by ``ml`` on ``system`` at each tolerance."""
    from diffnet.reference.elliptic import amg_cg

    a, b, free, u_full = system
    out = {}
    for rtol in rtols:
        t0 = time.perf_counter()
        x, info = amg_cg(ml, a, b, rtol, maxiter)
        out[rtol] = {"setup_s": setup_s, "solve_s": time.perf_counter() - t0,
                     "iterations": info["iterations"], "residual": info["residual"],
                     "rel_l2": rel_l2(field(x, free, u_full), u_ref)}
    return out


def export_system(path: str, system, u_ref, reference: str) -> None:
    """One draw's reduced system as plain arrays (CSR ``indptr``/``indices``/``data``, ``b``,
    the ``free`` mask, ``u_full`` with the Dirichlet values) and the reference solution
    ``u_ref`` over all nodes (``reference`` names it): what a solver needs to answer it and be
    scored as this bench scores."""
    import numpy as np

    a, b, free, u_full = system
    np.savez(path, indptr=a.indptr, indices=a.indices, data=a.data, b=b, free=free,
             u_full=u_full, u_ref=u_ref, reference=reference)


REFERENCE_RTOL = 1e-12  # --reference amg: CG to this relative residual stands for the exact solve
REFERENCE_MAXITER = 1000  # its own cap, not --maxiter's
REFERENCE_METHODS = {"direct": "direct", "amg": "amg_reference"}  # --reference -> row method


def reference_solve(system, kind: str):
    """(reference field, record) of ``system``: the reference solver's SuperLU
    (``solve_direct``), or its AMG-CG (``solve_amg``) to REFERENCE_RTOL; exits if that misses."""
    import numpy as np

    from diffnet.reference.elliptic import solve_amg, solve_direct

    a, b, free, u_full = system
    try:
        x, info = (solve_direct(a, b) if kind == "direct"
                   else solve_amg(a, b, REFERENCE_RTOL, REFERENCE_MAXITER))
    except RuntimeError as e:
        sys.exit(f"the AMG reference: {e}: use --reference direct")
    res = float(np.linalg.norm(b - a @ x) / np.linalg.norm(b))
    return field(x, free, u_full), {"setup_s": info["setup_time"], "solve_s": info["solve_time"],
                                    "iterations": info["iterations"], "residual": res,
                                    "rel_l2": 0.0}


def solve_draw(p, nu, rtols, maxiter, ml0=None, export=None, reference="direct"):
    """One draw: assembly, the reference solve (``reference``: "direct" or "amg"), AMG with its
    own hierarchy and, given ``ml0`` (draw 0's hierarchy), AMG with that setup reused; given
    ``export`` (a path), the system and the reference field are written there. Returns
    (record, reference field, own hierarchy)."""
    from diffnet.reference.elliptic import amg_hierarchy

    t0 = time.perf_counter()
    system = assemble(p, nu)
    a = system[0]
    rec = {"assemble_s": time.perf_counter() - t0, "unknowns": a.shape[0], "nnz": a.nnz}
    u, ref = reference_solve(system, reference)
    rec[REFERENCE_METHODS[reference]] = {None: ref}
    if export:
        export_system(export, system, u, REFERENCE_METHODS[reference])
    t0 = time.perf_counter()
    ml = amg_hierarchy(a)
    setup_s = time.perf_counter() - t0
    rec.update(amg_setup_s=setup_s, amg_levels=len(ml.levels),
               amg_complexity=ml.operator_complexity())
    rec["amg"] = cg_records(ml, system, u, rtols, maxiter, setup_s)
    if ml0 is not None:  # its setup was draw 0's, not this draw's
        rec["amg_reused"] = cg_records(ml0, system, u, rtols, maxiter, None)
    return rec, u, ml


def summarise(n: int, recs: list, method: str, rtol, maxiter: int) -> dict:
    """One configuration's row over the draws ``recs`` (draw 0 first): medians (and max for
    iterations, errors, residuals); ``converged``: no draw stopped at ``maxiter``."""
    rs = [r[method][rtol] for r in recs if method in r]
    med = lambda k: float(statistics.median(x[k] for x in rs))  # noqa: E731
    if method == "amg_reused":  # one setup (draw 0's) shared by all S = len(recs) draws
        setup = recs[0]["amg_setup_s"]
        total = setup / len(recs) + med("solve_s")
    else:
        setup = med("setup_s")
        total = float(statistics.median(x["setup_s"] + x["solve_s"] for x in rs))
    return {"N": n, "method": method, "rtol": rtol, "draws": len(rs), "setup_s": setup,
            "solve_s": med("solve_s"), "total_s": total,
            "iterations": med("iterations"), "iterations_max": max(x["iterations"] for x in rs),
            "rel_l2_vs_reference": med("rel_l2"),
            "rel_l2_vs_reference_max": max(x["rel_l2"] for x in rs),
            "residual_max": max(x["residual"] for x in rs),
            "converged": rtol is None or max(x["iterations"] for x in rs) < maxiter}


def measure_grid(n: int, args) -> tuple[dict, list]:
    """(grid info, rows) of one grid size over the draws."""
    p = make_problem(n, args)
    params = p.sample_params(args.seed, range(args.samples))
    recs, ml0 = [], None
    if args.export:
        os.makedirs(args.export, exist_ok=True)
    for i in range(args.samples):
        path = os.path.join(args.export, f"N{n}_draw{i}.npz") if args.export else None
        rec, _, ml = solve_draw(p, draw_nu(p, params, i), args.rtols, args.maxiter, ml0, path,
                                args.reference)
        ml0 = ml if i == 0 else ml0  # draw 0's hierarchy preconditions the later draws
        recs.append(rec)
    rows = [summarise(n, recs, REFERENCE_METHODS[args.reference], None, args.maxiter)]
    rows += [summarise(n, recs, "amg", t, args.maxiter) for t in args.rtols]
    if args.samples > 1:
        rows += [summarise(n, recs, "amg_reused", t, args.maxiter) for t in args.rtols]
    grid = {"N": n, "problem": p.config(), "unknowns": recs[0]["unknowns"],
            "nnz": recs[0]["nnz"], "assemble_s": statistics.median(r["assemble_s"] for r in recs),
            "amg_levels": recs[0]["amg_levels"], "amg_setup_s_draw0": recs[0]["amg_setup_s"],
            "amg_operator_complexity": recs[0]["amg_complexity"],
            "peak_rss_mib_after": peak_rss_mb(), "loadavg": load()}
    return grid, rows


def print_row(r: dict) -> None:
    tol = "-" if r["rtol"] is None else f"{r['rtol']:.0e}"
    once = " (draw 0's, once)" if r["method"] == "amg_reused" else ""
    print(f"N {r['N']:5d}  {r['method']:10s}  tol {tol:>5s}  setup {r['setup_s']:.4f} s{once}  "
          f"solve {r['solve_s']:.4f} s/sample  it {r['iterations']:g} (max "
          f"{r['iterations_max']})  rel L2 vs reference {r['rel_l2_vs_reference']:.2e}"
          + ("" if r["converged"] else "  (hit --maxiter)"), flush=True)


def measure(args) -> dict:
    warm = argparse.Namespace(**{**vars(args), "samples": 2, "export": None})
    # untimed: loads SuperLU, pyamg and the problem code (a small grid in 3-D)
    measure_grid(8 if get_dims(args.problem) == 3 else 16, warm)
    t_start, grids, rows = time.perf_counter(), [], []
    for n in args.sizes:
        grid, new = measure_grid(n, args)
        print(f"N {n:5d}: {grid['unknowns']} unknowns, assembly {grid['assemble_s']:.4f} s, "
              f"AMG {grid['amg_levels']} levels", flush=True)
        for r in new:
            print_row(r)
        grids.append(grid)
        rows += new
    return {"command": args.command, "problem": args.problem,
            "reference": "direct" if args.reference == "direct" else f"amg-cg {REFERENCE_RTOL:g}",
            "family": args.family if args.problem == "darcy" else None,
            "seed": args.seed, "samples": args.samples,
            "rtols": args.rtols, "maxiter": args.maxiter, "threads": args.threads,
            "times": "wall seconds per sample, medians over the draws",
            "machine": machine(), "grids": grids, "rows": rows,
            "peak_rss_mib": peak_rss_mb(), "seconds_total": round(time.perf_counter() - t_start, 2),
            "loadavg_end": load()}


def main(argv=None) -> int:
    args = parse(argv)
    fresh = set_threads(args.threads)
    check_problem(args.problem)
    res = measure(args)
    res["blas_threads_from_env"] = fresh
    emit_json(res, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
