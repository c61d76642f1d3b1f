"""How much of a trained model's test error is its answers' amplitude (issue #68, round 5).

For each test draw: the relative L2 error of the answer u, of the best multiple c u against the
reference (c = <u, ref> / <u, u>: the error left if only the amplitude were fixed), and of
the energy's best multiple g + c (u - g) (c from the residual alone, no reference: the K = 1
Ritz scaling a residual-energy head would apply), for a run of an example family whose
operator is symmetric. Usage (PYTHONPATH=examples/families:$PWD):

    python -m lab.tools.amplitude_gap runs/anisotropic_energy --samples 64
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

import deepfusion


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def energy_scale(p, u, x):
    """c minimising the energy of g + c (u - g), g the lift (the network's output 0)."""
    g = p.impose(torch.zeros_like(u), x)
    at_zero = p.residual(torch.zeros_like(u), x)
    apply = lambda v: p.residual(v, x) - at_zero          # noqa: E731
    v = (u - g) * mask(p, u)
    r_g = p.residual(g, x) * mask(p, u)
    return float(-(v * r_g).sum() / (v * apply(v)).sum())


def mask(p, u):
    m = torch.zeros_like(u)
    m[(slice(None), slice(None)) + (slice(1, -1),) * p.dims] = 1
    return m


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seed", type=int, default=271828)
    args = ap.parse_args(argv)
    solver = deepfusion.load(args.run)
    p = solver.problem
    params = p.sample_params(args.seed, range(args.samples))
    answers = solver.predict(params=params)
    rows = []
    for k in range(args.samples):
        ref = p.reference_solution(params[k])
        u = np.asarray(answers[k], dtype=np.float64)
        c = float((u * ref).sum() / (u * u).sum())
        x = p.build_input(params[k:k + 1], torch.float64)
        ut = torch.as_tensor(u)[None, None]
        ce = energy_scale(p, ut, x)
        g = p.impose(torch.zeros_like(ut), x)[0, 0].numpy()
        rows.append((rel(u, ref), rel(c * u, ref), rel(g + ce * (u - g), ref), c, ce))
    a = np.array(rows)
    for j, name in enumerate(("answer", "best multiple (reference)", "energy's multiple")):
        print(f"{name:28s} mean {a[:, j].mean():.4f} median {np.median(a[:, j]):.4f} "
              f"worst {a[:, j].max():.4f}")
    print(f"multiples: reference's {a[:, 3].min():.3f} .. {a[:, 3].max():.3f}, energy's "
          f"{a[:, 4].min():.3f} .. {a[:, 4].max():.3f}")


if __name__ == "__main__":
    main()
