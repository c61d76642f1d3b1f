"""Cheaper partition answers (``ritz_partition = m``), measured against the float64 one.

    python -m lab.tools.ritz_variants CKPT REF.h5 [--samples 4] [--partitions 8] [--fields 4,8]
                                  [--threads 2] [--out FILE.json]

CKPT is a checkpoint whose problem has an energy with two-point features and a Ritz answer
(``ritz = true``, K fields; Darcy, reaction-diffusion); REF.h5 from ``deepfusion solve`` on the
grid to answer on. Per sample the network's K fields are computed once, then answered five
ways, each printed as its relative L2 error against the reference and its distance to the
first:

* ``float64``: the problem's own answer (the cell Gram matrices in float64);
* ``float32_features``: the coloured fields rounded to float32 before they are differenced and
  scaled, the products still summed in float64;
* ``float32_gram``: the same with the products summed in float32 (float32 GEMM);
* ``fields_K'`` for each K' of ``--fields``: the partition over K' combinations of the K
  fields in place of all K (its Gram product costs (K'/K)^2): the plain Ritz answer, plus the
  K' - 1 smoothest directions energy-orthogonal to it (the largest L2 norm per unit energy).

The float64 answer is the shipped one; the others are the cuts measured and rejected in
``lab/notes/performance.md``, kept here so that their figures can be reproduced.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from unittest import mock

import numpy as np

from bench.common import emit_json, machine


def partition_answer(problem, u, nu, m: int, *, features32=False, sums32=False):
    """(H, W) float64: the problem's partition answer (``ritz.partition_combination``, cell by
    cell from windows) of the masked fields u (1, K, H, W). With ``features32`` the coloured
    fields are rounded to float32 before they are differenced and scaled; with ``sums32`` each
    cell's products are summed in float32 (``ritz.self_products`` is swapped for the call)."""
    import torch

    from diffnet.problems.contract import ritz
    from diffnet.problems.families.diffusion import trapezoid_weights

    dtype = torch.float32 if features32 else torch.float64
    nu_f = nu.to(dtype)

    def window(v, start, stop):
        return problem.quadratic_features_window(v.to(dtype), nu_f, start, stop)

    own = ritz.self_products
    # an ablation of one inner product, so the production code keeps no switch for it
    sums = (mock.patch.object(ritz, "self_products", lambda c: own(c.float()).double())
            if sums32 else contextlib.nullcontext())
    with sums:
        out = ritz.partition_combination(
            u, lambda v: problem.quadratic_features(v, nu),   # the undivided grid uses window
            problem.source * trapezoid_weights(problem.grid), problem.block.sum,
            ritz.Partition(problem.grid, m), problem.block, window_features=window)
    return out[0, 0].double()


def reduced_fields(problem, u, nu, kp: int):
    """(1, K', H, W) float64, energy-orthonormal: the plain Ritz answer of the K fields u, then
    the K' - 1 directions energy-orthogonal to it with the largest L2 norm per unit energy (a
    generalised eigenproblem on that complement, so K' = K spans the K fields)."""
    import torch

    from diffnet.problems.families.diffusion import trapezoid_weights
    from diffnet.problems.contract.ritz import gram

    v = u.double()
    k = v.shape[1]
    a = gram(problem.quadratic_features(v, nu), 1, k)[0]
    a = 0.5 * (a + a.T) + 1e-10 * a.diagonal().mean() * torch.eye(k, dtype=a.dtype)
    f = v[0].reshape(k, -1)
    wn = trapezoid_weights(problem.grid).reshape(1, -1)
    chol = torch.linalg.cholesky(a)                            # a = L L^T; y = L^T c
    inv = torch.linalg.inv(chol)
    c0 = torch.cholesky_solve((f * problem.source * wn).sum(1, keepdim=True), chol)
    e = chol.T @ c0
    e = e / e.norm()
    proj = torch.eye(k, dtype=a.dtype) - e @ e.T
    _, vec = torch.linalg.eigh(proj @ (inv @ ((f * wn) @ f.T) @ inv.T) @ proj)
    y = torch.cat([e, vec[:, k - kp + 1:]], 1)                 # e's eigenvalue there is 0
    return (f.T @ (inv.T @ y)).T.reshape(1, kp, *v.shape[2:])


def run(ckpt: str, ref_path: str, samples: int, m: int, fields) -> dict:
    import torch

    from deepfusion.app.fields_file import read_fields
    from deepfusion.engine.predict.loader import problem_from_spec, checkpoint_file, load_model

    ref = read_fields(ref_path)
    n, grid = min(samples, len(ref["u"])), list(ref["u"].shape[1:])
    ckpt = checkpoint_file(ckpt)
    model, problem, _, _ = load_model(ckpt, grid=grid, options={"ritz_partition": m})
    masking = problem_from_spec(problem.name, {**problem.config(), "ritz": False, "ritz_fields": 1,
                                           "ritz_partition": 0}, grid)   # the mask alone
    names = ["float64", "float32_features", "float32_gram"] + [f"fields_{kp}" for kp in fields]
    rows = {name: {"err": [], "moved": []} for name in names}
    dtype = next(model.parameters()).dtype
    with torch.inference_mode():
        for s in range(n):
            x = torch.as_tensor(ref["inputs"][s:s + 1], dtype=dtype)
            u_ref = torch.as_tensor(ref["u"][s], dtype=torch.float64)
            raw = model(x)
            base = problem.answer(raw, x)[0, 0].double()
            u, nu = masking.impose(raw, x), x[:, 0:1].double()
            answers = {"float64": base,
                       "float32_features": partition_answer(problem, u, nu, m, features32=True),
                       "float32_gram": partition_answer(problem, u, nu, m, features32=True,
                                                        sums32=True)}
            for kp in fields:
                answers[f"fields_{kp}"] = partition_answer(
                    problem, reduced_fields(problem, u, nu, kp), nu, m)
            for name, a in answers.items():
                rows[name]["err"].append(float((a - u_ref).norm() / u_ref.norm()))
                rows[name]["moved"].append(float((a - base).norm() / base.norm()))
            print(f"sample {s}: " + "  ".join(f"{k} {100 * r['err'][-1]:.2f}% (moved "
                                              f"{r['moved'][-1]:.1e})" for k, r in rows.items()),
                  flush=True)
    return {"checkpoint": ckpt, "reference": ref_path, "grid": grid, "samples": n,
            "partition": m,
            "variants": [{"name": k, "rel_l2": r["err"], "moved": r["moved"],
                          "mean_rel_l2": float(np.mean(r["err"]))} for k, r in rows.items()]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.tools.ritz_variants",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", help="a checkpoint file, or a run directory (its newest)")
    ap.add_argument("reference", help="REF.h5 from deepfusion solve (the grid answered on)")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--partitions", type=int, default=8, help="m of the partition")
    ap.add_argument("--fields", default="4,8", help="K' values, comma list")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/out/ritz_variants.json")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    res = run(args.checkpoint, args.reference, args.samples, args.partitions,
              [int(k) for k in args.fields.split(",") if k])
    for row in res["variants"]:
        print(f"{row['name']:>18}: mean {100 * row['mean_rel_l2']:.2f}%, moved "
              f"{min(row['moved']):.1e} to {max(row['moved']):.1e}")
    emit_json({"bench": "ritz_variants", "machine": machine(), "threads": args.threads, **res},
              args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
