"""Adam's fused kernel against its foreach update inside the trained step, alternated in one
process: the optimiser phase and the whole step, as ``deepfusion train`` runs it (freed memory
kept), round by round on the same model and inputs.

    python -m lab.tools.adam_ab [--grids 64:16,256:2] [--threads 1,2] [--rounds 12] [--out F]

Why alternated in one process: the difference (a few milliseconds) is smaller than the drift of
a shared host between two runs; rounds that alternate the order see the same host.
"""
from __future__ import annotations

import argparse
import json
import sys

from lab.tools.alternate import alternate, faster_rounds, medians


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


def main(argv=None) -> int:
    from bench.step_bench import parse_grids, parse_threads
    from deepfusion.engine.parallel.memory import reuse_freed_memory

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grids", default="64:16,256:2")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--out")
    a = p.parse_args(argv)
    reuse_freed_memory(True)
    runs = []
    for t in parse_threads(a.threads):
        for g, b in parse_grids(a.grids):
            r = measure(g, b, t, a.rounds)
            m = r["median_s"]
            print(f"{g}^2 b{b} t{t}: optimiser {m['foreach']['optimizer'] * 1e3:.2f} -> "
                  f"{m['fused']['optimizer'] * 1e3:.2f} ms (fused faster in "
                  f"{r['fused_optimizer_faster_rounds']}/{a.rounds} rounds); step "
                  f"{m['foreach']['step'] * 1e3:.0f} -> {m['fused']['step'] * 1e3:.0f} ms",
                  flush=True)
            runs.append(r)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
