"""The Ritz answer with coefficient fields (``ritz_partition = m``): error and cost against m.

    python -m lab.tools.ritz_partition CKPT REF.h5 [--partitions 0,2,4,8] [--samples 16]
                                   [--control] [--threads 2] [--out FILE.json]

REF.h5 from ``deepfusion solve`` on the grid to answer on (its /inputs are the network's
inputs, its /u the reference). For every m the checkpoint's problem is rebuilt with
``ritz_partition = m`` (m = 0: the plain combination) and the network's K fields, computed once
per sample, are combined by it: per m the relative L2 error (mean / median / worst), and the
median seconds of the network's forward pass and of the combination alone, at batch 1.
``--control`` adds the same partitions with one constant field in place of the network's (a
bilinear Galerkin solve on the m x m coarse grid with the fine-grid coefficient): how much of
the answer the coarse solve gives by itself. Choose m on a validation draw (``deepfusion solve
--seed 12345``, data.eval_seed), report on the test draw.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from bench.common import emit_json, machine


def _summary(errors) -> dict:
    e = np.asarray(errors)
    return {"mean": float(e.mean()), "median": float(np.median(e)), "worst": float(e.max()),
            "worst_index": int(e.argmax()), "n": len(e)}


def run(ckpt: str, ref_path: str, partitions, samples: int, control: bool) -> dict:
    import torch

    from deepfusion.app.fields_file import read_fields
    from deepfusion.engine.predict.loader import problem_from_spec, checkpoint_file, load_model

    ref = read_fields(ref_path)
    n = min(samples, len(ref["u"]))
    grid = list(ref["u"].shape[1:])
    ckpt = checkpoint_file(ckpt)
    model, problem, _, _ = load_model(ckpt, grid=grid)
    problems = {m: problem_from_spec(problem.name, {**problem.config(), "ritz_partition": m}, grid)
                for m in partitions}
    rows = {m: {"err": [], "sec": []} for m in partitions}
    ctrl = {m: [] for m in partitions if control and m > 0}
    forward, dtype = [], next(model.parameters()).dtype
    with torch.inference_mode():
        for s in range(n):
            x = torch.as_tensor(ref["inputs"][s:s + 1], dtype=dtype)
            u_ref = torch.as_tensor(ref["u"][s], dtype=torch.float64)
            t0 = time.perf_counter()
            raw = model(x)
            forward.append(time.perf_counter() - t0)
            for m, p in problems.items():
                t0 = time.perf_counter()
                u = p.answer(raw, x)
                rows[m]["sec"].append(time.perf_counter() - t0)
                rows[m]["err"].append(_rel(u, u_ref))
                if m in ctrl:
                    ones = torch.ones((1, 1, *grid), dtype=dtype)
                    ctrl[m].append(_rel(p.answer(ones, x), u_ref))
            print(f"sample {s}: " + "  ".join(f"m={m} {rows[m]['err'][-1]:.4f}"
                                              for m in partitions), flush=True)
    out = {"checkpoint": ckpt, "reference": ref_path, "grid": grid, "samples": n,
           "forward_s": float(np.median(forward)),
           "partitions": [{"m": m, "unknowns": problem.output_channels * (m + 1) ** 2,
                           "rel_l2": _summary(r["err"]),
                           "combination_s": float(np.median(r["sec"]))}
                          for m, r in rows.items()],
           "control_constant_field": [{"m": m, "rel_l2": _summary(e)} for m, e in ctrl.items()]}
    return out


def _rel(u, u_ref) -> float:
    u = u[0, 0].double()
    return float((u - u_ref).norm() / u_ref.norm())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", help="a checkpoint file, or a run directory (its newest)")
    ap.add_argument("reference", help="REF.h5 from deepfusion solve (the grid answered on)")
    ap.add_argument("--partitions", default="0,2,4,8")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--control", action="store_true",
                    help="add the constant-field control (the coarse solve alone)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/out/ritz_partition.json")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    parts = [int(m) for m in args.partitions.split(",")]
    res = run(args.checkpoint, args.reference, parts, args.samples, args.control)
    for row in res["partitions"]:
        e = row["rel_l2"]
        print(f"m={row['m']:3d} ({row['unknowns']:5d} unknowns): {100 * e['mean']:.2f}% / "
              f"{100 * e['median']:.2f}% / {100 * e['worst']:.2f}%  combination "
              f"{row['combination_s']:.3f} s  (forward {res['forward_s']:.3f} s)")
    for row in res["control_constant_field"]:
        e = row["rel_l2"]
        print(f"control m={row['m']:3d}: {100 * e['mean']:.1f}% / {100 * e['median']:.1f}% / "
              f"{100 * e['worst']:.1f}%")
    emit_json({"machine": machine(), "threads": args.threads, **res}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
