"""Does averaging the weights of a run's last checkpoints beat its last checkpoint?

    python -m lab.tools.checkpoint_average RUN_DIR [--last 1,4,8,16] [--draws 8] [--seed SEED]
                                       [--out bench/out/checkpoint_average.json]

For each K in ``--last``, the floating-point model tensors of the run's last K kept checkpoints
(step order) are averaged with equal weights (the cheap end of stochastic weight averaging:
no extra training) and the averaged network is evaluated on the run's final grid. K = 1 is the
last checkpoint itself. The draws default to the run's validation draw (``data.eval_seed``,
8 draws): this chooses K, so it must not be reported as a test result; evaluate the chosen K on
the test draw with ``--seed`` set to ``data.test_seed`` and ``--draws 64``.

The generators normalise with instance norm (no running statistics), so averaged weights need
no recalibration pass.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

from bench.common import emit_json
from lab.tools.error_vs_time import checkpoints, draws, errors


def model_states(paths: list[str]) -> list[dict]:
    from deepfusion.engine.checkpoint.store import load_checkpoint

    return [load_checkpoint(p)["model_state"] for p in paths]


def averaged_state(states: list[dict]) -> dict:
    """Equal-weight mean (in float64) of the floating tensors of the models' states; other
    entries are taken from the last state."""
    out = {}
    for name, t in states[-1].items():
        if torch.is_tensor(t) and t.is_floating_point():
            out[name] = (sum(s[name].double() for s in states) / len(states)).to(t.dtype)
        else:
            out[name] = t
    return out


def main(argv=None) -> int:
    from deepfusion.engine.predict.loader import load_model
    from deepfusion.config import load_config

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run")
    p.add_argument("--last", default="1,4,8,16", help="comma-separated K values")
    p.add_argument("--draws", type=int, default=8)
    p.add_argument("--seed", type=int, default=None, help="default: data.eval_seed of the run")
    p.add_argument("--out", default="bench/out/checkpoint_average.json")
    a = p.parse_args(argv)
    ks = sorted({int(k) for k in a.last.split(",")})
    paths = checkpoints(a.run)
    if not paths or ks[0] < 1 or ks[-1] > len(paths):
        p.error(f"--last needs values in 1..{len(paths)} (the run's kept checkpoints), got {a.last}")
    torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    seed = load_config(os.path.join(a.run, "config.toml")).data.eval_seed if a.seed is None else a.seed
    prob, params, refs, seed = draws(a.run, a.draws, seed)
    model = load_model(paths[-1], grid=tuple(prob.grid))[0]
    states = model_states(paths[-ks[-1]:])  # each checkpoint read once, for every K
    res = {"run": a.run, "draws": a.draws, "seed": seed, "grid": list(prob.grid), "rows": []}
    for k in ks:
        model.load_state_dict(averaged_state(states[-k:]))
        e = errors(model, prob, params, refs)
        row = {"last": k, "first": os.path.basename(paths[-k]), "mean": float(e.mean()),
               "median": float(np.median(e)), "worst": float(e.max())}
        res["rows"].append(row)
        print(f"last {k:3d} checkpoints (from {row['first']}): mean {e.mean():.4f} "
              f"median {np.median(e):.4f} worst {e.max():.4f}", flush=True)
    emit_json(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
