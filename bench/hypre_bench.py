"""hypre's BoomerAMG (through petsc4py) on the systems ``bench.fem_bench --export`` wrote.

    python -m bench.fem_bench --sizes 1024 --samples 2 --family fine-scale --rtols 1e-8,1e-1 \\
        --threads 1 --export /tmp/sys1024 --out bench/out/fem_darcy1024_export.json
    PYTHON_WITH_PETSC bench/hypre_bench.py /tmp/sys1024 --rtols 1e-8,1e-1 \\
        --out bench/out/hypre_darcy1024.json [--maxiter 300] [--copies 2] [--option KEY=VALUE ...]

Why: pyamg, the reference's AMG, drives its setup from Python; a production FEM code on a
cluster would call a compiled AMG, most often hypre's BoomerAMG through PETSc. The comparison of
the network against "AMG" should hold against that one too.

It runs under any Python that imports petsc4py (built with hypre), numpy and nothing of this
repository, because petsc4py is rarely installable into the project's venv: PyPI has it only
as source that builds PETSc. On Debian 12: ``apt-get install python3-petsc4py-real3.18`` and run
with ``PYTHONPATH=/usr/lib/petscdir/petsc3.18/x86_64-linux-gnu-real/lib/python3/dist-packages
/usr/bin/python3``; on a cluster, the site's PETSc module.

For every ``N{N}_draw{i}.npz`` in DIR: the CSR matrix becomes a PETSc AIJ matrix (timed apart as
``to_petsc_s``, the step a PETSc code would spend assembling), then CG preconditioned with one
BoomerAMG V-cycle (hypre's defaults unless ``--option`` sets ``pc_hypre_boomeramg_*`` keys):
``setup_s`` is the preconditioner's setup (the hierarchy, built once per draw and shared by the
tolerances), ``solve_s`` the CG solve from zero to ``||b - A x|| <= rtol ||b||`` (the
unpreconditioned residual, as pyamg's CG in ``bench.fem_bench`` measures it). Errors are relative
L2 against the draw's reference solution (fem_bench's: the direct solve, or AMG-CG to 1e-12
with ``--reference amg``) over all nodes, boundary included, as in ``bench.fem_bench``. Times
are wall seconds per draw, medians over the draws of a grid, each process on one core.
``--copies K`` runs K such processes at once on the same draws, as a node answering many draws
runs one solve per core; rows then hold the medians over the copies and ``node_s_per_answer``
(total / K), the figure to set against a network that uses the whole node for its answers.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import resource
import statistics
import sys
import time


def parse(argv):
    ap = argparse.ArgumentParser(prog="bench/hypre_bench.py", description=__doc__.split("\n")[0])
    ap.add_argument("systems", help="directory of N{N}_draw{i}.npz from bench.fem_bench --export")
    ap.add_argument("--rtols", default="1e-8,1e-1", help="CG relative residuals, comma list")
    ap.add_argument("--maxiter", type=int, default=300, help="CG iteration cap")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="a PETSc option without the dash, e.g. "
                    "pc_hypre_boomeramg_strong_threshold=0.5")
    ap.add_argument("--copies", type=int, default=1,
                    help="K processes at once on the same draws (node for node: one per core)")
    ap.add_argument("--out", default=None, help="JSON path (default: print it)")
    args = ap.parse_args(argv)
    args.command = " ".join([ap.prog] + (sys.argv[1:] if argv is None else list(argv)))
    args.rtols = [float(r) for r in args.rtols.split(",")]
    if not all(0 < r < 1 for r in args.rtols) or args.maxiter < 1 or args.copies < 1:
        ap.error(f"--rtols must lie in (0, 1), --maxiter and --copies be >= 1; got {args.rtols}, "
                 f"{args.maxiter}, {args.copies}")
    if not os.path.isdir(args.systems):
        ap.error(f"{args.systems} is not a directory: write one with "
                 "python -m bench.fem_bench ... --export DIR")
    return args


def import_petsc(options):
    """petsc4py's PETSc module, initialised with ``options`` (KEY=VALUE strings); exits with
    how to get it where this Python has none."""
    try:
        import petsc4py
    except ImportError:
        sys.exit("bench/hypre_bench.py needs petsc4py (with hypre) in this Python: on Debian 12 "
                 "apt-get install python3-petsc4py-real3.18 and run it with PYTHONPATH="
                 "/usr/lib/petscdir/petsc3.18/x86_64-linux-gnu-real/lib/python3/dist-packages "
                 "/usr/bin/python3; on a cluster, load the site's PETSc module")
    petsc4py.init([sys.argv[0]])  # options come from --option only, not this command line
    from petsc4py import PETSc

    opts = PETSc.Options()
    for kv in options:
        key, _, value = kv.partition("=")
        if not key:
            sys.exit(f"--option {kv!r}: expected KEY=VALUE")
        opts[key.lstrip("-")] = value
    return PETSc


def systems(directory: str) -> dict:
    """{N: [npz paths in draw order]} of the directory; exits when there is none."""
    found: dict = {}
    for path in glob.glob(os.path.join(directory, "N*_draw*.npz")):
        m = re.fullmatch(r"N(\d+)_draw(\d+)\.npz", os.path.basename(path))
        if m:
            found.setdefault(int(m[1]), []).append((int(m[2]), path))
    if not found:
        sys.exit(f"no N{{N}}_draw{{i}}.npz in {directory}: write them with "
                 "python -m bench.fem_bench ... --export DIR")
    return {n: [p for _, p in sorted(v)] for n, v in sorted(found.items())}


def solve_draw(PETSc, path: str, rtols, maxiter: int) -> dict:
    """One draw's record: conversion, setup and, per tolerance, solve, iterations, residual and
    error against the exported reference solution."""
    import numpy as np

    z = np.load(path)
    b_np, free, u_full, u_ref = z["b"], z["free"], z["u_full"], z["u_ref"]
    n = b_np.size
    t0 = time.perf_counter()
    a = PETSc.Mat().createAIJ(size=(n, n), csr=(z["indptr"].astype(PETSc.IntType),
                                                z["indices"].astype(PETSc.IntType), z["data"]))
    a.assemble()
    rec = {"unknowns": n, "to_petsc_s": time.perf_counter() - t0, "reference": str(z["reference"])}
    ksp = PETSc.KSP().create()
    ksp.setOperators(a)
    ksp.setType("cg")
    ksp.setNormType(PETSc.KSP.NormType.UNPRECONDITIONED)
    ksp.getPC().setType("hypre")
    ksp.getPC().setHYPREType("boomeramg")
    ksp.setFromOptions()
    t0 = time.perf_counter()
    ksp.setUp()
    rec["setup_s"] = time.perf_counter() - t0
    b, x = a.createVecRight(), a.createVecLeft()
    b.setArray(b_np)
    bnorm = float(np.linalg.norm(b_np))
    for rtol in rtols:
        ksp.setTolerances(rtol=rtol, atol=0.0, max_it=maxiter)
        x.set(0.0)
        t0 = time.perf_counter()
        ksp.solve(b, x)
        solve_s = time.perf_counter() - t0
        r = a.createVecLeft()
        a.mult(x, r)
        u = u_full.copy()
        u[free] = x.getArray()
        rec[str(rtol)] = {"solve_s": solve_s, "iterations": ksp.getIterationNumber(),
                          "residual": float(np.linalg.norm(b_np - r.getArray())) / bnorm,
                          "rel_l2": float(np.linalg.norm(u - u_ref) / np.linalg.norm(u_ref)),
                          "converged": ksp.getConvergedReason() > 0}
    return rec


def summarise(n: int, recs: list, rtol: float) -> dict:
    """The row of one grid and tolerance over its draws: medians; max for errors, iterations."""
    rs = [r[str(rtol)] for r in recs]
    med = statistics.median
    return {"N": n, "method": "boomeramg", "rtol": rtol, "draws": len(recs),
            "to_petsc_s": med(r["to_petsc_s"] for r in recs),
            "setup_s": med(r["setup_s"] for r in recs), "solve_s": med(x["solve_s"] for x in rs),
            "total_s": med(r["setup_s"] + r[str(rtol)]["solve_s"] for r in recs),
            "iterations": med(x["iterations"] for x in rs),
            "iterations_max": max(x["iterations"] for x in rs),
            "reference": recs[0]["reference"], "rel_l2_vs_reference": med(x["rel_l2"] for x in rs),
            "rel_l2_vs_reference_max": max(x["rel_l2"] for x in rs),
            "residual_max": max(x["residual"] for x in rs),
            "converged": all(x["converged"] for x in rs)}


def measure(args) -> dict:
    """One process: every grid's rows (the warm-up solve of each grid untimed)."""
    found = systems(args.systems)
    PETSc = import_petsc(args.option)
    rows = []
    for n, paths in found.items():
        solve_draw(PETSc, paths[0], args.rtols[:1], args.maxiter)  # untimed: loads hypre
        recs = [solve_draw(PETSc, p, args.rtols, args.maxiter) for p in paths]
        rows += [summarise(n, recs, rtol) for rtol in args.rtols]
    return {"petsc": ".".join(map(str, PETSc.Sys.getVersion())), "rows": rows,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def measure_copies(args, argv) -> dict:
    """``--copies`` K processes at once on the same draws (one per core: a node answering many
    draws); each row's times are the median over the copies, and ``node_s_per_answer`` is that
    total / K."""
    import subprocess
    import tempfile

    base = list(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"copy{i}.json") for i in range(args.copies)]
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *base,
                                   "--copies", "1", "--out", out], stdout=subprocess.DEVNULL)
                 for out in outs]
        if any(p.wait() != 0 for p in procs):
            sys.exit("a copy of bench/hypre_bench.py failed (run it with --copies 1 to see why)")
        copies = []
        for out in outs:
            with open(out) as f:
                copies.append(json.load(f))
    rows = []
    for i, row in enumerate(copies[0]["rows"]):
        same = [c["rows"][i] for c in copies]
        row = {**row, **{k: statistics.median(r[k] for r in same)
                         for k in ("to_petsc_s", "setup_s", "solve_s", "total_s")}}
        rows.append({**row, "copies": args.copies,
                     "node_s_per_answer": row["total_s"] / args.copies})
    return {"petsc": copies[0]["petsc"], "rows": rows,
            "peak_rss_mib": max(c["peak_rss_mib"] for c in copies)}


def print_row(row: dict) -> None:
    node = (f"  node {row['node_s_per_answer']:.3f} s/answer ({row['copies']} at once)"
            if "copies" in row else "")
    print(f"N {row['N']:5d}  boomeramg  tol {row['rtol']:.0e}  to PETSc {row['to_petsc_s']:.3f} s  "
          f"setup {row['setup_s']:.3f} s  solve {row['solve_s']:.3f} s/sample  it "
          f"{row['iterations']:g} (max {row['iterations_max']})  rel L2 vs {row['reference']} "
          f"{row['rel_l2_vs_reference']:.2e}{node}"
          + ("" if row["converged"] else "  (not converged)"), flush=True)


def main(argv=None) -> int:
    args = parse(argv)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):  # one core per process, before
        os.environ[var] = "1"                                 # numpy and hypre load
    res = measure(args) if args.copies == 1 else measure_copies(args, argv)
    for row in res["rows"]:
        print_row(row)
    res = {"command": args.command, "options": args.option, "rtols": args.rtols,
           "maxiter": args.maxiter, "copies": args.copies,
           "times": "wall seconds per sample, medians over the draws (and over the copies)",
           **res, "loadavg_end": [round(v, 2) for v in os.getloadavg()]}
    text = json.dumps(res, indent=1)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
        print(f"-> {args.out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
