"""What a level change keeps: a checkpoint's network run as it is on finer grids, against its
prediction on its own grid interpolated (bilinear on nodes) to those grids.

    python -m lab.tools.level_transfer CKPT.h5 [--grids 128,256] [--draws 8] [--seed 12345]
                                   [--out bench/out/level_transfer.json]

Relative L2 against the problem's reference on each grid, mean over ``--draws`` draws of
``--seed`` (default the validation seed). A fully convolutional network's filters are in node
units, so the same weights on a grid twice as fine compute another function; this measures how
far from the solution a multigrid schedule's next level starts, either way.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from bench.common import emit_json


def measure(path: str, grids, draws: int, seed: int) -> dict:
    from deepfusion.engine.predict.loader import load_model
    from diffnet.metrics import relative_l2
    from diffnet.problems import get_problem
    from diffnet.resample import resample_nodes

    model, prob, _, _ = load_model(path)
    opts = {k: v for k, v in prob.config().items() if k != "grid"}
    params = prob.sample_params(seed, np.arange(draws))
    x0 = prob.build_input(params)
    with torch.no_grad():
        u0 = prob.answer(model(x0), x0)
    own = np.stack([prob.reference_solution(q) for q in params])
    out = {"checkpoint": path, "grid": list(prob.grid), "draws": draws, "seed": seed,
           "own_grid": float(relative_l2(u0[:, 0].numpy(), own).mean()), "finer": []}
    for g in grids:
        p = get_problem(prob.name, grid=(g, g), **opts)
        x = p.build_input(params)
        with torch.no_grad():
            u = p.answer(model(x), x)
        ref = np.stack([p.reference_solution(q) for q in params])
        ui = resample_nodes(u0, (g, g))
        out["finer"].append({"grid": [g, g],
                             "weights_as_they_are": float(relative_l2(u[:, 0].numpy(), ref).mean()),
                             "interpolated": float(relative_l2(ui[:, 0].numpy(), ref).mean())})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--grids", default="128,256", help="finer square grids, comma separated")
    p.add_argument("--draws", type=int, default=8)
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--out", default="bench/out/level_transfer.json")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    res = measure(a.checkpoint, [int(g) for g in a.grids.split(",") if g], a.draws, a.seed)
    print(f"{res['grid'][0]}^2 network on its grid: {res['own_grid']:.4f}")
    for r in res["finer"]:
        print(f"on {r['grid'][0]}^2: weights as they are {r['weights_as_they_are']:.4f}, "
              f"its {res['grid'][0]}^2 prediction interpolated {r['interpolated']:.4f}")
    emit_json(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
