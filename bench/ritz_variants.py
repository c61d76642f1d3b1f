"""Cheaper partition answers (``ritz_partition = m``), measured against the float64 one.

    python -m bench.ritz_variants CKPT REF.h5 [--samples 4] [--partitions 8] [--fields 4,8]
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
``notes/performance.md``, kept here so that their figures can be reproduced.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from bench.common import emit_json, machine


def cell_answer(problem, u, nu, m: int, dtype, gram_dtype):
    """(H, W) float64 partition answer of the masked fields u (1, K, H, W), the coloured fields
    and their scaled features in ``dtype``, each cell's products summed in ``gram_dtype``."""
    import torch

    from diffnet.problems.fields import trapezoid_weights
    from diffnet.problems.ritz import Partition, solve_gram

    k, grid = u.shape[1], problem.grid
    part = Partition(grid, m)
    v = u.double()
    colours = part.colours(problem.block, v)
    j = (m + 1) ** 2
    g = torch.zeros(k * j, k * j, dtype=torch.float64)
    for rng, hats in part.cells():
        start = [lo for lo, _ in rng]
        stop = [n if hi is None else hi for (_, hi), n in zip(rng, grid)]
        win = tuple(slice(a, min(z + 1, n)) for a, z, n in zip(start, stop, grid))
        coloured = (v[(..., None) + win] * colours[(...,) + win]).reshape(
            1, 4 * k, *(s.stop - s.start for s in win)).to(dtype)
        cell = 0
        for f, w in problem.quadratic_features_window(coloured, nu.to(dtype), start, stop):
            f = (f * w.sqrt()).reshape(4 * k, -1).to(gram_dtype)
            cell = cell + 2 * (f @ f.T).double()
        idx = torch.arange(k).repeat_interleave(4) * j + torch.tensor(hats).repeat(k)
        g[idx[:, None], idx[None, :]] += cell
    hy, hx = part.hats
    load = problem.source * trapezoid_weights(grid)
    rhs = (hy @ ((v[0] * load) @ hx.T)).reshape(1, -1)
    c = solve_gram(g[None], rhs)[0].view(k, m + 1, m + 1)
    return (v[0] * (hy.T @ c @ hx)).sum(0)


def reduced_fields(problem, u, nu, kp: int):
    """(1, K', H, W) float64, energy-orthonormal: the plain Ritz answer of the K fields u, then
    the K' - 1 directions energy-orthogonal to it with the largest L2 norm per unit energy (a
    generalised eigenproblem on that complement, so K' = K spans the K fields)."""
    import torch

    from diffnet.problems.fields import trapezoid_weights
    from diffnet.problems.ritz import gram

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

    from deepfusion.app.fields import read_fields
    from deepfusion.app.inference import build_problem, checkpoint_file, load_model

    ref = read_fields(ref_path)
    n, grid = min(samples, len(ref["u"])), list(ref["u"].shape[1:])
    ckpt = checkpoint_file(ckpt)
    model, problem, _, _ = load_model(ckpt, grid=grid, options={"ritz_partition": m})
    masking = build_problem(problem.name, {**problem.config(), "ritz": False, "ritz_fields": 1,
                                           "ritz_partition": 0}, grid)   # the mask alone
    names = ["float64", "float32_features", "float32_gram"] + [f"fields_{kp}" for kp in fields]
    rows = {name: {"err": [], "moved": []} for name in names}
    dtype = next(model.parameters()).dtype
    with torch.inference_mode():
        for s in range(n):
            x = torch.as_tensor(ref["inputs"][s:s + 1], dtype=dtype)
            u_ref = torch.as_tensor(ref["u"][s], dtype=torch.float64)
            raw = model(x)
            base = problem.impose(raw, x)[0, 0].double()
            u, nu = masking.impose(raw, x), x[:, 0:1].double()
            answers = {"float64": base,
                       "float32_features": cell_answer(problem, u, nu, m, torch.float32,
                                                       torch.float64),
                       "float32_gram": cell_answer(problem, u, nu, m, torch.float32,
                                                   torch.float32)}
            for kp in fields:
                answers[f"fields_{kp}"] = cell_answer(problem, reduced_fields(problem, u, nu, kp),
                                                      nu, m, torch.float64, torch.float64)
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
    ap = argparse.ArgumentParser(prog="python -m bench.ritz_variants",
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
