"""Time deepfusion's training step (LossAndGrad: forward, energy loss, backward, gradient
buckets) on poisson3d in NCDHW and in channels_last_3d (NDHWC), float32, one thread.

    python -m lab.tools.memformat3d_bench [--grid 16] [--reps 15]

The two layouts are timed interleaved (A B A B ...) and the median is reported, so a loaded
machine slows both alike.
"""
import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from deepfusion.config import ParallelConfig  # noqa: E402
from deepfusion.engine.parallel.comm import SerialComm  # noqa: E402
from deepfusion.engine.parallel.memformat import as_format, convert_model  # noqa: E402
from deepfusion.engine.parallel.parallelize import parallelize  # noqa: E402
from deepfusion.engine.train.step import LossAndGrad  # noqa: E402
from diffnet.generators import build_generator  # noqa: E402
from diffnet.problems import get_problem  # noqa: E402

NETS = {"depth2_w4-16": dict(depth=2, base_width=4, max_width=16),
        "depth3_w8-64": dict(depth=3, base_width=8, max_width=64),
        "depth3_w16-128": dict(depth=3, base_width=16, max_width=128),
        "depth4_w16-128_default": dict(depth=4, base_width=16, max_width=128)}


def step_fn(task, opts, cl, x, batch):
    torch.manual_seed(0)
    model = build_generator("unet3d", in_channels=2, **opts).float()
    model = convert_model(model, cl)
    pm = parallelize(model, SerialComm(), ParallelConfig())
    lg = LossAndGrad(pm, task, global_batch=batch, term_names=task.loss_term_names,
                     channels_last=cl)
    return lambda: lg(x)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--grid", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    torch.set_num_threads(1)
    task = get_problem("poisson3d", grid=(a.grid,) * 3)
    rng = np.random.default_rng(0)
    b = task.param_bounds()
    x = task.build_input(rng.uniform(b[:, 0], b[:, 1], (a.batch, len(b))))
    out = {"grid": a.grid, "batch": a.batch, "threads": 1, "torch": torch.__version__}
    for name, opts in NETS.items():
        if a.grid ** 3 < 2 * 8 ** opts["depth"]:  # instance norm needs >= 2 coarsest nodes
            continue
        fns = {cl: step_fn(task, opts, cl, x, a.batch) for cl in (False, True)}
        times = {False: [], True: []}
        for fn in fns.values():
            for _ in range(3):
                fn()  # warm-up
        for _ in range(a.reps):
            for cl, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                times[cl].append(time.perf_counter() - t0)
        ncdhw, ndhwc = statistics.median(times[False]), statistics.median(times[True])
        out[name] = {"ncdhw_s": round(ncdhw, 4), "channels_last_3d_s": round(ndhwc, 4),
                     "ncdhw_over_cl3d": round(ncdhw / ndhwc, 3)}
        print(name, out[name], flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
