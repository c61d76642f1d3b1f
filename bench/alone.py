"""Each convolution of a measured step run again alone: the same call (shapes, strides, memory
format, arguments) with nothing around it, against its time inside the step; and the step's best
case in eager PyTorch, every convolution as fast as alone and every other op at its bound.

    from bench.alone import conv_alone      # rows of bench.opmeter.measure_ops

Why: the roofline's compute ceiling is the best rate of the step's convolutions alone, the
largest-channel one's. The small-channel, full-resolution convolutions run below it even alone,
so a step can be far from that bound with every kernel as fast as oneDNN makes it.
``best_eager_over_bound`` says how far: above 1.5, no change around the kernels (fusion of the
elementwise ops, layouts, less Python) brings the step within 1.5x of its bound; only faster
convolution kernels, or fewer convolution FLOPs, would.

A call is recorded as a spec (:func:`spec`): the op's name and its arguments, each tensor as its
shape, strides and dtype. Replayed on fresh random tensors of the same layout, best of three
after a warm-up call (oneDNN builds its primitive on the first).
"""
from __future__ import annotations

import json
import time

# The ops replayed alone: the step's convolutions, forward and backward.
REPLAYED = ("convolution", "convolution_backward")


def spec(name: str, args) -> str:
    """The call ``name(*args)`` as a JSON string: tensors by shape, strides and dtype."""
    import torch

    def enc(v):
        if isinstance(v, torch.Tensor):
            return {"t": [list(v.shape), list(v.stride()), str(v.dtype).replace("torch.", "")]}
        if isinstance(v, (list, tuple)):
            return [enc(x) for x in v]
        return v
    return json.dumps([name, [enc(a) for a in args]])


def _args(encoded):
    import torch

    def dec(v):
        if isinstance(v, dict) and "t" in v:
            shape, stride, dtype = v["t"]
            return torch.empty_strided(shape, stride, dtype=getattr(torch, dtype)).normal_()
        if isinstance(v, list):
            return [dec(x) for x in v]
        return v
    return [dec(a) for a in encoded]


def replay_seconds(call: str, repeats: int = 3) -> float:
    """Best wall seconds of the call ``call`` (a :func:`spec`) alone, after one warm-up call."""
    import torch

    name, encoded = json.loads(call)
    func, args = getattr(torch.ops.aten, name).default, _args(encoded)
    func(*args)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        func(*args)
        best = min(best, time.perf_counter() - t)
    return best


def conv_alone(rows: list[dict], bound) -> dict:
    """The convolutions of ``rows`` (measure_ops rows with ``replays``: {spec: calls per step})
    in the step and alone, and the step's eager best case: every row without replays counts at
    ``bound(row)``, its lower bound in seconds."""
    in_step = alone = others = 0.0
    for r in rows:
        if r.get("replays"):
            in_step += r["seconds"]
            alone += sum(n * replay_seconds(call) for call, n in r["replays"].items())
        else:
            others += bound(r)
    return {"conv_in_step_s": in_step, "conv_alone_s": alone, "others_at_bound_s": others,
            "best_eager_s": alone + others}
