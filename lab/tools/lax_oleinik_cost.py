"""What the Lax-Oleinik loss costs with its closed-form gradient, against autograd through it.

    python -m lab.tools.lax_oleinik_cost [--grid 512] [--batch 2] [--repeats 5] [--threads 1]
                                     [--out bench/out/lax_oleinik_cost.json]

The loss's forward + backward on one rank's share of a step (``--batch`` samples of c in
[3, 16] on a ``--grid`` x ``--grid`` Burgers grid, random u), with the smoothing on (the
8-point Gauss-Hermite average, sigma 0.2: the first half of the recipes) and off, for:
  closed    ``diffnet.problems.families.lax_oleinik`` as the loss uses it (the slope computed beside
            the value, backward one multiplication);
  autograd  the same functional, ``lax_oleinik_value`` (g through ``primitive_at``),
            differentiated by autograd (what the loss did before).
Reported: median seconds of forward + backward (after a warm-up call), and the bytes the
forward pass saves for backward (counted with ``saved_tensors_hooks``: what autograd keeps
alive between the passes, which grows with the grid and the batch). Also the basin term's
neighbour search (``basin_targets``, no gradient) at reach 1 and 4, with g computed with and
without the slope, and what one masked ``torch.where`` costs against a multiplication.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from bench.common import emit_json, machine, median_seconds


def setup(grid: int, batch: int):
    from diffnet.primitive import node_primitive
    from diffnet.problems.families.burgers import Burgers

    p = Burgers(grid=(grid, grid), c_range=(3.0, 16.0), scheme="lax-oleinik", hard_bc=True)
    dt, dx = p.spacing
    u0 = p.build_input(np.linspace(3.0, 16.0, batch)[:, None])[:, 0, 0, :]
    big = node_primitive(u0, dx)
    t = torch.arange(1, grid, dtype=torch.float32)[:, None] * dt
    x = torch.arange(grid, dtype=torch.float32) * dx
    torch.manual_seed(0)
    v = (0.5 * torch.rand(batch, grid - 1, grid)).requires_grad_()
    return v, (big, u0, x, t, big[:, None, :], dx)


def closed(v, args, points):
    from diffnet.problems.families.lax_oleinik import lax_oleinik_nodes

    return lax_oleinik_nodes(v, *args, points)


def autograd(v, args, points):
    from diffnet.problems.families.lax_oleinik import lax_oleinik_value

    return sum(w * lax_oleinik_value(v + s, *args) for s, w in points)


def saved_bytes(fn) -> int:
    total = 0

    def pack(x):
        nonlocal total
        total += x.numel() * x.element_size()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn()
    return total


def main(argv=None) -> None:
    from diffnet.problems.families.lax_oleinik import smoothing_points

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--grid", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    v, args = setup(a.grid, a.batch)
    rows = []
    for sigma in (0.2, 0.0):
        points = smoothing_points(sigma)
        for name, fn in (("closed", closed), ("autograd", autograd)):
            def step():
                v.grad = None
                fn(v, args, points).mean().backward()
            rows.append({"path": name, "smoothing": sigma,
                         "seconds": median_seconds(step, a.repeats),
                         "saved_mib": saved_bytes(lambda: fn(v, args, points)) / 2**20})
            r = rows[-1]
            print(f"smoothing {sigma:3.1f}  {name:8s}  forward + backward {r['seconds']:.3f} s"
                  f"  saved for backward {r['saved_mib']:7.1f} MiB")
    emit_json({"bench": "lax_oleinik_cost", "grid": a.grid, "batch": a.batch,
               "threads": a.threads, "repeats": a.repeats, "machine": machine(),
               "rows": rows, "basin": basin_rows(v.detach(), args, a.repeats),
               "elementwise": elementwise_rows(v.detach(), a.repeats)}, a.out)


def elementwise_rows(v, repeats: int) -> list[dict]:
    """Why the functional avoids masks: one masked ``torch.where`` against one multiplication
    and against the select written as ``lerp`` with a 0/1 weight, on the same tensors."""
    other = v.flip(-1).contiguous()
    mask = v < other
    weight = mask.to(v.dtype)
    ops = {"multiply": lambda: v * other,
           "torch.where (bool mask)": lambda: torch.where(mask, v, other),
           "lerp (0/1 weight)": lambda: torch.lerp(other, v, weight)}
    rows = []
    for name, fn in ops.items():
        seconds = median_seconds(lambda: [fn() for _ in range(10)], repeats) / 10
        rows.append({"op": name, "milliseconds": 1e3 * seconds})
        print(f"elementwise on {tuple(v.shape)}  {name:24s}  {1e3 * seconds:.3f} ms")
    return rows


def basin_rows(v, args, repeats: int) -> list[dict]:
    """The basin term's neighbour search (no gradient), with g evaluated by the loss's own
    function (value and slope) and by the value-only one it uses."""
    from diffnet.problems.families.lax_oleinik import (basin_targets, lax_oleinik_nodes,
                                              lax_oleinik_value)

    ways = {"value+slope": lambda c: lax_oleinik_nodes(c, *args, [(0.0, 1.0)]),
            "value only": lambda c: lax_oleinik_value(c, *args)}
    rows = []
    for reach in (1, 4):
        for name, value_at in ways.items():
            seconds = median_seconds(lambda: basin_targets(v, value_at, reach), repeats)
            rows.append({"reach": reach, "g": name, "seconds": seconds})
            print(f"basin search  reach {reach}  g {name:11s}  {seconds:.3f} s")
    return rows


if __name__ == "__main__":
    main()
