"""train.fused_kernels against the eager norm + GELU inside the trained step, alternated in one
process: the forward, backward and whole step, as ``deepfusion train`` runs it (freed memory
kept), round by round on the same weights and inputs; and the two networks' losses.

    python -m lab.tools.fused_ab [--grids 64:16,256:2] [--threads 1,2] [--rounds 10] [--out F]
"""
from __future__ import annotations

import argparse
import json
import sys

from lab.tools.alternate import alternate, faster_rounds, medians

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


def main(argv=None) -> int:
    from bench.step_bench import parse_grids, parse_threads
    from deepfusion.engine.parallel.memory import reuse_freed_memory

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grids", default="64:16,256:2")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--out")
    a = p.parse_args(argv)
    reuse_freed_memory(True)
    runs = []
    for t in parse_threads(a.threads):
        for g, b in parse_grids(a.grids):
            r = measure(g, b, t, a.rounds)
            m = r["median_s"]
            print(f"{g}^2 b{b} t{t}: " + "; ".join(
                f"{ph} {m['eager'][ph] * 1e3:.0f} -> {m['fused'][ph] * 1e3:.0f} ms"
                for ph in ("step",) + PHASES) +
                f" (fused faster in {r['fused_faster_rounds']}/{a.rounds} rounds); first loss "
                f"{r['first_loss']['eager']:.6g} / {r['first_loss']['fused']:.6g}", flush=True)
            runs.append(r)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
