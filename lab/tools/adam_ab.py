"""Adam's fused kernel against its foreach update inside the trained step, alternated in one
process: the optimiser phase and the whole step, as ``deepfusion train`` runs it (freed memory
kept), round by round on the same model and inputs.

    python -m lab.tools.adam_ab [--grids 64:16,256:2] [--threads 1,2] [--rounds 12] [--out F]

Why alternated in one process: the difference (a few milliseconds) is smaller than the drift of
a shared host between two runs; rounds that alternate the order see the same host.
"""
from __future__ import annotations

import sys

from lab.tools.alternate import ab_main, alternate, faster_rounds, medians


def measure(grid: int, batch: int, threads: int, rounds: int) -> dict:
    import torch

    from bench.common import build, inputs
    from bench.step_bench import foreach_adam, make_deepfusion

    torch.set_num_threads(threads)
    prob, model = build("burgers", grid, "unet", channels_last=True)
    fused = make_deepfusion(prob, model, inputs(prob, batch))
    steps = {"foreach": foreach_adam(fused), "fused": fused}   # one model, either update
    times = alternate(steps, rounds, phases=("optimizer",))
    med = medians(times)
    faster = faster_rounds(times, "foreach", "fused", "optimizer")
    return {"grid": grid, "batch": batch, "threads": threads, "rounds": rounds, "median_s": med,
            "fused_optimizer_faster_rounds": faster, "times_s": times}


def line(r: dict) -> str:
    m = r["median_s"]
    return (f"{r['grid']}^2 b{r['batch']} t{r['threads']}: optimiser "
            f"{m['foreach']['optimizer'] * 1e3:.2f} -> {m['fused']['optimizer'] * 1e3:.2f} ms "
            f"(fused faster in {r['fused_optimizer_faster_rounds']}/{r['rounds']} rounds); step "
            f"{m['foreach']['step'] * 1e3:.0f} -> {m['fused']['step'] * 1e3:.0f} ms")


def main(argv=None) -> int:
    return ab_main(argv, __doc__, measure, line, rounds=12)


if __name__ == "__main__":
    sys.exit(main())
