"""The fp32 rate of a lone 3x3 convolution (oneDNN, channels_last) next to torch.mm's, on this CPU.

    python -m bench.conv_rate [--threads 1] [--bf16] [--out bench/out/conv_rate.json]

`make bench` divides the training step's counted FLOP rate by torch.mm's 2048^2 rate. Where
torch.mm's BLAS is not the CPU's best fp32 product (on some CPUs oneDNN's 3x3 convolution runs
well above torch.mm's rate), that ratio overstates the step; this prints both so the
denominator can be judged. The FLOPs of a convolution are counted as 2 * 9 * C_in * C_out * H * W
per sample (a kernel that does fewer operations, e.g. Winograd, shows a higher rate).

``--bf16`` also times each convolution with bf16 input and weights, and prints how many times
slower or faster than fp32 it runs. On a CPU with AVX512-BF16 or AMX oneDNN runs them; on one
without (e.g. an AVX2-only CPU), PyTorch falls back to its generic im2col convolution, and this
measures what that costs: the figure behind the refusal of ``train.precision = "bf16"`` there.
"""
from __future__ import annotations

import argparse
import sys
import time

from bench.common import emit_json

SHAPES = ((32, 256), (64, 128), (128, 64), (256, 32))  # (channels, H = W), batch 2
MM_SIZES = (512, 1024, 2048, 4096)


def _seconds(f, repeats: int) -> float:
    f(), f()  # warm-up: primitive creation, caches
    t0 = time.perf_counter()
    for _ in range(repeats):
        f()
    return (time.perf_counter() - t0) / repeats


def _conv_seconds(c: int, h: int, dtype, repeats: int) -> float:
    import torch
    import torch.nn.functional as F

    x = torch.randn(2, c, h, h, dtype=dtype).contiguous(memory_format=torch.channels_last)
    w = torch.randn(c, c, 3, 3, dtype=dtype).contiguous(memory_format=torch.channels_last)
    return _seconds(lambda: F.conv2d(x, w, padding=1), repeats)


def run(threads: int = 1, repeats: int = 5, shapes=SHAPES, mm_sizes=MM_SIZES,
        bf16: bool = False) -> dict:
    import torch

    torch.set_num_threads(threads)
    out = {"threads": threads, "conv3x3": [], "mm": []}
    with torch.no_grad():
        for c, h in shapes:
            flop = 2 * 9 * c * c * h * h * 2
            s = _conv_seconds(c, h, torch.float32, repeats)
            row = {"channels": c, "grid": h, "batch": 2, "gflops": flop / s / 1e9}
            if bf16:
                s16 = _conv_seconds(c, h, torch.bfloat16, repeats)
                row.update(gflops_bf16=flop / s16 / 1e9, bf16_slowdown=s16 / s)
            out["conv3x3"].append(row)
        for n in mm_sizes:
            a, b = torch.randn(n, n), torch.randn(n, n)
            s = _seconds(lambda: torch.mm(a, b), max(1, repeats // 2))
            out["mm"].append({"n": n, "gflops": 2 * n ** 3 / s / 1e9})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bf16", action="store_true", help="also time each convolution in bf16")
    p.add_argument("--out", default="bench/out/conv_rate.json")
    a = p.parse_args(argv)
    res = run(a.threads, a.repeats, bf16=a.bf16)
    for r in res["conv3x3"]:
        bf = (f"; bf16 {r['gflops_bf16']:.0f} GF/s, {r['bf16_slowdown']:.2f}x the fp32 time"
              if a.bf16 else "")
        print(f"conv3x3 C={r['channels']:4d} {r['grid']}^2 b2: {r['gflops']:.0f} GF/s{bf}")
    for r in res["mm"]:
        print(f"torch.mm {r['n']}^2: {r['gflops']:.0f} GF/s")
    emit_json(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
