"""How much the coarse correction (``diffnet.problems.coarse_correction``) takes off a trained
run's error, for each partition size (issue #68, round 6).

For the draws of ``--seed`` (tune the cells on the validation seed 12345; report on the test
seed 271828): the network's answers, then each corrected with ``--cells`` m (0: one global
factor), their relative L2 errors against the family's reference (mean, median, worst) and
the seconds per answer of the correction. Usage (PYTHONPATH=examples/families:$PWD):

    python -m lab.tools.residual_partition runs/anisotropic_ebf16 --samples 64 --cells 0,4,8,16
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

import deepfusion
from deepfusion.engine.parallel.memory import peak_rss_mib, reuse_freed_memory
from diffnet.problems import coarse_correction


def errors(answers, refs) -> np.ndarray:
    n = len(refs)
    return (np.linalg.norm((answers - refs).reshape(n, -1), axis=1)
            / np.linalg.norm(refs.reshape(n, -1), axis=1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seed", type=int, default=12345)
    ap.add_argument("--cells", default="0,4,8,16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="a JSON file for the rows")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    reuse_freed_memory(True)      # as evaluate and infer do: the cost is theirs
    solver = deepfusion.load(args.run, correction=0)     # the network's own answers
    p = solver.problem
    params = p.sample_params(args.seed, range(args.samples))
    answers = np.asarray(solver.predict(params=params), dtype=np.float64)
    refs = np.stack([p.reference_solution(q) for q in params])
    x = p.build_input(params, torch.float64)
    u = torch.as_tensor(answers)[:, None]
    rows = [("network", errors(answers, refs), 0.0)]
    for m in (int(s) for s in args.cells.split(",")):
        coarse_correction(p, u[:1], x[:1], m)      # warm-up: the loss's first call checks it
        t = time.perf_counter()
        fixed = coarse_correction(p, u, x, m)[:, 0].numpy()
        rows.append((f"cells {m}", errors(fixed, refs), (time.perf_counter() - t) / len(u)))
    for name, e, s in rows:
        print(f"{name:10s} mean {e.mean():.4%} median {np.median(e):.4%} worst {e.max():.4%}"
              f"  {s:.3f} s per answer ({len(e)} draws, seed {args.seed})")
    print(f"peak RSS of the process {peak_rss_mib():.0f} MiB")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"run": args.run, "seed": args.seed, "samples": args.samples,
                       "threads": args.threads, "step": solver.step,
                       "peak_rss_mib": peak_rss_mib(),
                       "rows": [{"answer": name, "mean": float(e.mean()),
                                 "median": float(np.median(e)), "worst": float(e.max()),
                                 "seconds_per_answer": s} for name, e, s in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
