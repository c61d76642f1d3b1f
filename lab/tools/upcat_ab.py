"""The compiled upsampling + concatenation (diffnet.kernels.upcat) against the eager Up, alternated
in one process: the decoder's Up modules alone (forward + backward at the shapes the trained
step gives them), and the whole step with the norm + GELU kernel in both, so that the
difference is this kernel's; and the two steps' first losses.

    python -m lab.tools.upcat_ab [--grids 64:16,256:2] [--threads 1,2] [--rounds 10] [--out F]
"""
from __future__ import annotations

import sys

from lab.tools.alternate import ab_main, alternate, faster_rounds, medians


def up_calls(model, x):
    """(Up module, its x, its skip) for every Up of ``model`` on input ``x``."""
    from diffnet.generators import Up

    calls = []
    hooks = [m.register_forward_pre_hook(lambda m, a: calls.append((m, *a)))
             for m in model.modules() if isinstance(m, Up)]
    model(x)
    for h in hooks:
        h.remove()
    return [(m, a.detach().requires_grad_(), s.detach().requires_grad_()) for m, a, s in calls]


def measure(grid: int, batch: int, threads: int, rounds: int) -> dict:
    import torch

    from bench.common import build, inputs
    from bench.step_bench import make_deepfusion
    from diffnet.kernels import fuse_norm_gelu, fuse_upsample_cat

    torch.set_num_threads(threads)
    prob, plain = build("burgers", grid, "unet", channels_last=True)
    kernel = build("burgers", grid, "unet", channels_last=True)[1]
    fuse_norm_gelu(plain), fuse_norm_gelu(kernel)
    fuse_upsample_cat(kernel)  # only this kernel differs (not the Winograd convolutions)
    kernel.load_state_dict(plain.state_dict())
    x = inputs(prob, batch)
    steps = {"eager": make_deepfusion(prob, plain, x), "fused": make_deepfusion(prob, kernel, x)}
    first = {k: float(s()) for k, s in steps.items()}
    step_times = alternate(steps, rounds)
    ups = {"eager": merged_step(up_calls(plain, x)), "fused": merged_step(up_calls(kernel, x))}
    up_times = alternate(ups, rounds)
    return {"grid": grid, "batch": batch, "threads": threads, "rounds": rounds,
            "first_loss": first, "step_median_s": medians(step_times),
            "ups_median_s": medians(up_times),
            "step_faster_rounds": faster_rounds(step_times, "eager", "fused"),
            "ups_faster_rounds": faster_rounds(up_times, "eager", "fused"),
            "step_times_s": step_times, "ups_times_s": up_times}


def merged_step(calls):
    """Forward + backward of every captured Up's upsampling and concatenation alone (the
    ConvBlock after it is the same in both variants), with a unit output gradient."""
    import torch

    def step():
        for m, a, s in calls:
            out = m.merge(a, s)  # the kernel in a FusedUp, the eager ops in an Up
            torch.autograd.grad(out, (a, s), torch.ones_like(out))
    return step


def line(r: dict) -> str:
    s, u = r["step_median_s"], r["ups_median_s"]
    return (f"{r['grid']}^2 b{r['batch']} t{r['threads']}: the Ups' upsampling + concatenation "
            f"(forward + backward) {u['eager']['step'] * 1e3:.2f} -> "
            f"{u['fused']['step'] * 1e3:.2f} ms (kernel faster in {r['ups_faster_rounds']}/"
            f"{r['rounds']} rounds); step {s['eager']['step'] * 1e3:.0f} -> "
            f"{s['fused']['step'] * 1e3:.0f} ms ({r['step_faster_rounds']}/{r['rounds']}); "
            f"first loss {r['first_loss']['eager']:.6g} / {r['first_loss']['fused']:.6g}")


def main(argv=None) -> int:
    return ab_main(argv, __doc__, measure, line, rounds=10)


if __name__ == "__main__":
    sys.exit(main())
