"""The cost of the Ritz combination: the Gram matrix by one product against polarisation.

    python -m lab.tools.ritz_bench [--grid 512] [--fields 1,4,8,16] [--batch 2] [--threads 1]
                               [--repeats 3] [--partitions 2,8] [--out bench/out/ritz.json]

For each K of ``--fields``, on ``--batch`` fine-scale Darcy draws at ``--grid``² (the problem
``darcy_fine.toml`` trains, ``ritz = true, ritz_fields = K``), times impose + energy + backward
from K random fields (median of ``--repeats`` after one warm-up), the work the Ritz route adds to
a training step besides the network, with G assembled two ways side by side:

* ``product``: as the problem does it (``diffnet.problems.contract.ritz``): the energy as weighted
  squares, G_ij = 2 sum(w F(u_i) F(u_j)), one batched matrix product;
* ``polarisation``: G_ij = a(u_i + u_j) - a(u_i) - a(u_j) from K + K(K - 1)/2 evaluations of
  the energy (the first version of ``ritz_combination``), here as a stand-in with the same
  interface.

It also reports the largest relative difference between the two combinations (they agree to
float32 rounding: polarisation subtracts energies and is the less exact of the two) and the
process's peak RSS. One line per K; JSON (``emit_json``) to ``--out``.

``--partitions m1,m2,..`` times instead the answer with coefficient fields (``ritz_partition =
m``, K = the last of ``--fields``) on the same random fields, one sample at a time as
``deepfusion infer`` answers: impose alone (no autograd, the inference cost) and impose +
energy + backward (the training cost; c a constant to autograd). It does not depend on the
network, so the cost can be compared across commits with the same command.
"""
from __future__ import annotations

import argparse
import sys

import torch

from bench.common import emit_json, machine, median_seconds, peak_rss_mb
from diffnet.problems import get_problem
from diffnet.problems.contract import ritz
def polarised_gram(features: list, b: int, k: int) -> torch.Tensor:
    """(b, k, k) G from energies alone: a(v, v) = 2 sum(w F(v)^2) of the k fields and of the
    k(k - 1)/2 pairwise sums (F is linear, so F(u_i + u_j) = F(u_i) + F(u_j)), and
    a(u, v) = (a(u + v, u + v) - a(u, u) - a(v, v)) / 2."""
    def energy(i, j=None):
        return sum(2 * (w * (f[:, i] if j is None else f[:, i] + f[:, j]).unsqueeze(1).square())
                   .flatten(1).sum(1) for f, w in features)

    diag = [energy(i).double() for i in range(k)]
    g = torch.diag_embed(torch.stack(diag, dim=1))
    for i in range(k):
        for j in range(i + 1, k):
            g[:, i, j] = g[:, j, i] = 0.5 * (energy(i, j).double() - diag[i] - diag[j])
    return g


def time_one(problem, x, u, repeats: int) -> tuple[float, torch.Tensor]:
    """Median seconds of impose + energy + backward after one warm-up, and the answer."""
    last = []

    def step():
        out = problem.answer(u.detach().requires_grad_(), x)
        problem.loss_terms(out, x)["pde"].sum().backward()
        last[:] = [out.detach()]

    return median_seconds(step, repeats), last[0]


def run(grid: int, fields: list[int], batch: int, repeats: int) -> list[dict]:
    rows, product = [], ritz.gram
    for k in fields:
        p = get_problem("darcy", grid=(grid, grid), family="fine-scale", output_scale=0.01,
                        ritz=True, ritz_fields=k)
        x = p.build_input(p.sample_params(0, range(batch)))
        u = torch.randn((batch, k, grid, grid), generator=torch.Generator().manual_seed(k))
        row = {"grid": grid, "fields": k, "batch": batch}
        for name, gram in (("product", product), ("polarisation", polarised_gram)):
            ritz.gram = gram            # the module-level hook ritz_combination calls
            try:
                row[f"{name}_s"], row[f"{name}_out"] = time_one(p, x, u, repeats)
            finally:
                ritz.gram = product
        a, b = row.pop("product_out"), row.pop("polarisation_out")
        row["rel_diff"] = float((a - b).norm() / b.norm())
        row["speedup"] = row["polarisation_s"] / row["product_s"]
        print(f"{grid}² K={k:2d} batch {batch}: product {row['product_s']:.3f} s, polarisation "
              f"{row['polarisation_s']:.3f} s ({row['speedup']:.1f}x), answers differ by "
              f"{row['rel_diff']:.1e}", flush=True)
        rows.append(row)
    return rows


def run_partitions(grid: int, k: int, partitions: list[int], repeats: int) -> list[dict]:
    rows = []
    for m in partitions:
        p = get_problem("darcy", grid=(grid, grid), family="fine-scale", output_scale=0.01,
                        ritz=True, ritz_fields=k, ritz_partition=m)
        x = p.build_input(p.sample_params(0, [0]))
        u = torch.randn((1, k, grid, grid), generator=torch.Generator().manual_seed(k))
        with torch.no_grad():   # not inference_mode: the problem caches masks for training
            answer = median_seconds(lambda: p.answer(u, x), repeats)
        train, _ = time_one(p, x, u, repeats)
        rows.append({"grid": grid, "fields": k, "partition": m, "batch": 1,
                     "impose_s": answer, "impose_energy_backward_s": train})
        print(f"{grid}² K={k:2d} ritz_partition={m}: impose {answer:.3f} s, impose + energy + "
              f"backward {train:.3f} s (one sample)", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.tools.ritz_bench",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--grid", type=int, default=512)
    ap.add_argument("--fields", default="1,4,8,16", help="K values, comma list")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--partitions", default="",
                    help="m values: time the answer with coefficient fields instead (K = the "
                         "last of --fields)")
    ap.add_argument("--out", default="bench/out/ritz.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    fields = [int(k) for k in a.fields.split(",")]
    if a.partitions:
        rows = run_partitions(a.grid, fields[-1], [int(m) for m in a.partitions.split(",")],
                              a.repeats)
    else:
        rows = run(a.grid, fields, a.batch, a.repeats)
    emit_json({"bench": "ritz", "machine": machine(), "threads": a.threads, "rows": rows,
               "peak_rss_mb": peak_rss_mb()}, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
