"""This host's ceilings for the roofline of a training step (bench/roofline.py): the sustained
memory bandwidth of streaming torch kernels, the fp32 GEMM rate, and the fp32 rate of the
model's own convolutions, each at a given thread count.

    python -m bench.host_probe [--threads 1,2] [--out bench/out/host_probe.json]

Run by the bench when it builds a roofline, never at import. Every figure is the best of a few
timed repeats (a ceiling: the fastest this host was seen to run the kernel, so load from other
jobs lowers it less than a median would).

* Bandwidth: STREAM's copy (``b.copy_(a)``: 2 arrays moved) and triad (``torch.add(b, c,
  alpha=s, out=a)``: 3 arrays) at several footprints (all arrays together), from cache-sized to
  well past the last-level cache. Bytes are counted as STREAM counts them (no write-allocate
  traffic). ``gbs`` at a footprint is the larger of the two kernels' rates there.
* GEMM: ``torch.mm`` of two 2048 x 2048 fp32 matrices (the bench's GEMM reference).
* Convolutions: each distinct forward convolution of the step (input, weight, stride, padding,
  as the step ran them: channels_last), alone, FLOPs counted as torch's FLOP counter counts them
  (2 x MACs). A 3x3 convolution from oneDNN can run well above torch.mm's rate on some CPUs,
  so the compute ceiling of the roofline is the larger of the GEMM rate and the best of these.
"""
from __future__ import annotations

import argparse
import sys
import time

from bench.common import cpu_flags, emit_json, gemm_flops, gemm_seconds

FOOTPRINTS_MIB = (1, 4, 16, 64, 256, 1024)
GEMM_N = 2048


def _best_seconds(fn, repeats: int, inner: int = 1) -> float:
    """Best time of one call of fn over ``repeats`` timings of ``inner`` calls (after a warm-up)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t) / inner)
    return best


def _inner_calls(footprint_bytes: int) -> int:
    # Enough calls per timing that a small footprint's time is well above the timer's and
    # the call overhead is amortised as in a run of such ops (~256 MiB moved per timing).
    return max(1, (256 << 20) // footprint_bytes)


def stream(threads: int, footprints_mib=FOOTPRINTS_MIB, repeats: int = 3) -> list[dict]:
    """Copy and triad bandwidth (GB/s) at each total footprint, ``threads`` threads."""
    import torch

    torch.set_num_threads(threads)
    rows = []
    for mib in footprints_mib:
        n3, n2 = (mib << 20) // 12, (mib << 20) // 8   # fp32 elements per array
        a, b, c = torch.ones(n3), torch.ones(n3), torch.ones(n3)
        triad = _best_seconds(lambda: torch.add(b, c, alpha=3.0, out=a), repeats,
                              _inner_calls(12 * n3))
        del a, b, c
        x, y = torch.ones(n2), torch.empty(n2)
        copy = _best_seconds(lambda: y.copy_(x), repeats, _inner_calls(8 * n2))
        del x, y
        row = {"footprint_mib": mib, "triad_gbs": 12 * n3 / triad / 1e9,
               "copy_gbs": 8 * n2 / copy / 1e9}
        row["gbs"] = max(row["triad_gbs"], row["copy_gbs"])
        rows.append(row)
    return rows


def gemm_gflops(threads: int, n: int = GEMM_N, repeats: int = 3) -> float:
    import torch

    torch.set_num_threads(threads)
    gemm_seconds(n)                                    # warm-up: the inputs, the BLAS threads
    return gemm_flops(n) / min(gemm_seconds(n).wall for _ in range(repeats)) / 1e9


def conv_flops(x_shape, w_shape, stride, padding, transposed: bool = False) -> float:
    """FLOPs (2 x multiply-adds) of one forward convolution, as torch.utils.flop_counter counts
    them: 2 * N * C_out * prod(out spatial) * C_in/groups * prod(kernel)."""
    from torch.utils.flop_counter import conv_flop_count

    out = [x_shape[0], w_shape[0]] + [
        (n + 2 * p - k) // s + 1 for n, k, s, p in zip(x_shape[2:], w_shape[2:], stride, padding)]
    return float(conv_flop_count(list(x_shape), list(w_shape), out, transposed))


def conv_gflops(shapes, threads: int, repeats: int = 3) -> list[dict]:
    """The fp32 rate of each forward convolution in ``shapes`` (dicts with x, w, stride,
    padding, groups), alone, channels_last, ``threads`` threads."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    rows = []
    with torch.no_grad():
        for s in shapes:
            x = torch.randn(s["x"]).contiguous(memory_format=torch.channels_last)
            w = torch.randn(s["w"]).contiguous(memory_format=torch.channels_last)
            sec = _best_seconds(lambda: F.conv2d(x, w, stride=s["stride"], padding=s["padding"],
                                                 groups=s["groups"]), repeats)
            flops = conv_flops(s["x"], s["w"], s["stride"], s["padding"])
            rows.append({**s, "gflops": flops / sec / 1e9})
    return rows


def isa() -> dict:
    """What the CPU offers the fp32 and bf16 kernels (the ceilings depend on it)."""
    import torch

    flags = cpu_flags()
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "avx512": "avx512f" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "amx_bf16": "amx_bf16" in flags, "avx2": "avx2" in flags}


def ceilings(threads: int, conv_shapes=(), repeats: int = 5,
             footprints_mib=FOOTPRINTS_MIB) -> dict:
    """The roofline's ceilings at ``threads`` threads: ``compute_gflops`` (the larger of the GEMM
    rate and the best of ``conv_shapes``' rates, with ``compute_source`` saying which),
    ``bandwidth`` (GB/s by footprint), ``dram_gbs`` (the largest footprint's)."""
    bw = stream(threads, footprints_mib, repeats)
    return {"threads": threads, **compute_ceiling(threads, conv_shapes, repeats),
            "bandwidth": bw, "dram_gbs": bw[-1]["gbs"]}


def compute_ceiling(threads: int, conv_shapes=(), repeats: int = 5) -> dict:
    """The compute part of :func:`ceilings`: the GEMM rate, each of ``conv_shapes``' rates,
    and ``compute_gflops``, the larger of GEMM and the best convolution (``compute_source``)."""
    gemm = gemm_gflops(threads, repeats=repeats)
    convs = conv_gflops(conv_shapes, threads, repeats) if conv_shapes else []
    best_conv = max(convs, key=lambda r: r["gflops"], default=None)
    use_conv = best_conv is not None and best_conv["gflops"] > gemm
    return {"gemm_gflops": gemm, "conv": convs,
            "conv_best_gflops": best_conv["gflops"] if best_conv else None,
            "compute_gflops": best_conv["gflops"] if use_conv else gemm,
            "compute_source": (f"conv x{list(best_conv['x'])} w{list(best_conv['w'])}"
                               if use_conv else f"torch.mm {GEMM_N}^2")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default="1,2")
    p.add_argument("--out", default="bench/out/host_probe.json")
    a = p.parse_args(argv)
    res = {"isa": isa(), "ceilings": [ceilings(int(t)) for t in a.threads.split(",")]}
    for c in res["ceilings"]:
        print(f"threads {c['threads']}: GEMM {c['gemm_gflops']:.0f} GF/s; bandwidth " +
              ", ".join(f"{r['footprint_mib']} MiB {r['gbs']:.0f}" for r in c["bandwidth"]) +
              " GB/s")
    emit_json(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
