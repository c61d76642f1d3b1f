"""The Winograd convolutions (diffnet.kernels.winograd) against oneDNN's inside the trained step,
alternated in one process: both steps with the norm + GELU and upsampling + concatenation
kernels, so that the difference is the 3x3 stride-1 convolutions'; and the two steps' first
losses (equal to float32 rounding, not bit for bit).

    python -m lab.tools.winograd_ab [--grids 64:16,256:2] [--threads 1,2] [--rounds 10] [--out F]
"""
from __future__ import annotations

import sys

from lab.tools.alternate import ab_main, alternate, faster_rounds, medians


def measure(grid: int, batch: int, threads: int, rounds: int) -> dict:
    import torch

    from bench.common import build, inputs
    from bench.step_bench import make_deepfusion
    from diffnet.kernels import fuse_norm_gelu, fuse_upsample_cat, fuse_winograd

    torch.set_num_threads(threads)
    prob, onednn = build("burgers", grid, "unet", channels_last=True)
    wino = build("burgers", grid, "unet", channels_last=True)[1]
    wino.load_state_dict(onednn.state_dict())
    for m in (onednn, wino):
        fuse_norm_gelu(m), fuse_upsample_cat(m)
    swapped = fuse_winograd(wino)
    x = inputs(prob, batch)
    steps = {"onednn": make_deepfusion(prob, onednn, x), "winograd": make_deepfusion(prob, wino, x)}
    first = {k: float(s()) for k, s in steps.items()}
    times = alternate(steps, rounds)
    return {"grid": grid, "batch": batch, "threads": threads, "rounds": rounds,
            "convolutions_swapped": swapped, "first_loss": first,
            "step_median_s": medians(times),
            "faster_rounds": faster_rounds(times, "onednn", "winograd"), "step_times_s": times}


def line(r: dict) -> str:
    s = r["step_median_s"]
    return (f"{r['grid']}^2 b{r['batch']} t{r['threads']}: step {s['onednn']['step'] * 1e3:.0f}"
            f" -> {s['winograd']['step'] * 1e3:.0f} ms ({r['convolutions_swapped']} convolutions"
            f" by Winograd; faster in {r['faster_rounds']}/{r['rounds']} rounds); first loss "
            f"{r['first_loss']['onednn']:.7g} / {r['first_loss']['winograd']:.7g}")


def main(argv=None) -> int:
    return ab_main(argv, __doc__, measure, line, rounds=10)


if __name__ == "__main__":
    sys.exit(main())
