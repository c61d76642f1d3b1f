"""train.fused_kernels (every compiled kernel) against the eager modules inside the trained
step, alternated in one process: the forward, backward and whole step, as ``deepfusion train`` runs it (freed memory
kept), round by round on the same weights and inputs; and the two networks' losses.

    python -m lab.tools.fused_ab [--grids 64:16,256:2] [--threads 1,2] [--rounds 10] [--out F]
"""
from __future__ import annotations

import sys

from lab.tools.alternate import ab_main, alternate, faster_rounds, medians

PHASES = ("forward", "backward")


def measure(grid: int, batch: int, threads: int, rounds: int) -> dict:
    import torch

    from bench.common import build, fused, inputs
    from bench.step_bench import make_deepfusion

    torch.set_num_threads(threads)
    prob, eager = build("burgers", grid, "unet", channels_last=True)
    kernel = fused(build("burgers", grid, "unet", channels_last=True)[1])
    if kernel is None:
        raise SystemExit("fused_ab: the kernel cannot be built here (reason above)")
    kernel.load_state_dict(eager.state_dict())
    x = inputs(prob, batch)
    steps = {"eager": make_deepfusion(prob, eager, x), "fused": make_deepfusion(prob, kernel, x)}
    first = {k: float(s()) for k, s in steps.items()}  # the same weights: the same loss
    times = alternate(steps, rounds, phases=PHASES)
    return {"grid": grid, "batch": batch, "threads": threads, "rounds": rounds,
            "first_loss": first, "median_s": medians(times),
            "fused_faster_rounds": faster_rounds(times, "eager", "fused"), "times_s": times}


def line(r: dict) -> str:
    m = r["median_s"]
    phases = "; ".join(f"{ph} {m['eager'][ph] * 1e3:.0f} -> {m['fused'][ph] * 1e3:.0f} ms"
                       for ph in ("step",) + PHASES)
    return (f"{r['grid']}^2 b{r['batch']} t{r['threads']}: {phases} (fused faster in "
            f"{r['fused_faster_rounds']}/{r['rounds']} rounds); first loss "
            f"{r['first_loss']['eager']:.6g} / {r['first_loss']['fused']:.6g}")


def main(argv=None) -> int:
    return ab_main(argv, __doc__, measure, line, rounds=10)


if __name__ == "__main__":
    sys.exit(main())
