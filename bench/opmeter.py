"""Every aten call of a training step, counted: its FLOPs, the bytes it moves and its wall time,
by (phase, layer, op), with each convolution call recorded to be run again alone (bench/alone.py).
What bench/roofline.py bounds.

Per call (a TorchDispatchMode sees every aten call, so autograd's backward and the optimiser's
foreach kernels are counted as well as the forward):
  * FLOPs: torch.utils.flop_counter's formulas (convolutions forward and backward, matmuls;
    2 x multiply-adds); 0 for every other op (elementwise, reductions, copies);
  * bytes: a lower bound on the traffic: every distinct tensor read once (the op's inputs, a
    broadcast input counted once) and written once (its outputs and the arguments it mutates);
    views and allocations move nothing;
  * time: wall seconds of the call (inclusive of the kernels it dispatches to).
"""
from __future__ import annotations

import statistics
import time

from bench import alone
# Allocation-only ops: no element of memory is read or written.
NO_TRAFFIC = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")


def tensor_bytes(t) -> int:
    """Bytes of the distinct elements of t (a broadcast dimension, stride 0, counts once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def _tensors(values):
    import torch

    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors(v)


def _key(t):
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _distinct_bytes(tensors) -> int:
    return sum(tensor_bytes(t) for t in {_key(t): t for t in tensors}.values())


def op_bytes(func, args, kwargs, out) -> int:
    """Reads (inputs, ``out=`` excluded) + writes (outputs and mutated arguments), each distinct
    tensor once; 0 for views (every output shares an input's storage, nothing mutated) and for
    allocations."""
    if func.__name__.split(".")[0] in NO_TRAFFIC:
        return 0
    schema = func._schema
    mutated, reads = [], []
    named = list(zip(schema.arguments, args)) + [
        (a, kwargs[a.name]) for a in schema.arguments if a.name in kwargs]
    for arg, value in named:
        ts = list(_tensors([value]))
        if arg.alias_info is not None and arg.alias_info.is_write:
            mutated += ts
        if not (arg.kwarg_only and arg.name == "out"):
            reads += ts
    outs = list(_tensors([out]))
    if not mutated and outs:
        storages = {t.untyped_storage().data_ptr() for t in reads}
        if all(t.untyped_storage().data_ptr() in storages for t in outs):
            return 0  # a view of an input
    return _distinct_bytes(reads) + _distinct_bytes(outs + mutated)


def op_flops(func, args, kwargs, out) -> float:
    from torch.utils.flop_counter import flop_registry

    f = flop_registry.get(func.overloadpacket)
    return float(f(*args, **kwargs, out_val=out)) if f is not None else 0.0



class OpMeter:
    """Context manager: every aten op run inside it, timed and counted, grouped by (phase,
    layer, op). Phase: forward (inside the network) / loss (outside it, before backward: the
    answer and the loss terms) / backward (the network's) / loss_backward (the rest of
    backward) / optimiser (after backward: gradient sync, clipping, the update). Layer: the
    innermost module running (its backward, in backward), '-' outside any module.
    ``network``: the class name of the network's root module (ModuleTracker's name for it);
    modules of other roots are the loss's."""

    def __init__(self, network: str | None = None):
        self.rows: dict = {}
        self.after_backward = False
        self.network = network

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.module_tracker import ModuleTracker

        meter, tracker = self, ModuleTracker()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                t = time.perf_counter()
                out = func(*args, **kwargs)
                meter.add(func, args, kwargs, out, time.perf_counter() - t, tracker)
                return out

        self._tracker, self._mode = tracker.__enter__(), Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        self._tracker.__exit__(*exc)

    def add(self, func, args, kwargs, out, seconds, tracker):
        modules = [p for p in tracker.parents if p != "Global"]
        layer = max(modules, key=lambda p: p.count(".")) if modules else "-"
        # A module outside the network (the loss's stencils) counts to the loss.
        in_network = self.network is None or layer.split(".")[0] == self.network
        # Not grad mode: a custom autograd Function's forward (the NHWC norm) runs without it.
        if tracker.is_bw:
            phase = "backward" if modules and in_network else "loss_backward"
            self.after_backward = True
        elif self.after_backward:
            phase, layer = "optimiser", "-"
        else:
            phase = "forward" if modules and in_network else "loss"
        name = str(func.overloadpacket).replace("aten.", "")
        row = self.rows.setdefault((phase, layer, name), {
            "phase": phase, "layer": layer, "op": name, "calls": 0, "flops": 0.0,
            "bytes": 0.0, "call_bytes": {}, "seconds": 0.0,
            "shapes": [list(t.shape) for t in list(_tensors(args))[:3]]})
        if name in alone.REPLAYED:  # each distinct call, to be run again alone (bench.alone)
            call = alone.spec(name, args)
            row.setdefault("replays", {})[call] = row.get("replays", {}).get(call, 0) + 1
        if name == "convolution" and "conv" not in row:  # stride, padding, groups: the probe's
            row["conv"] = {"stride": list(args[3]), "padding": list(args[4]), "groups": args[8],
                           "transposed": bool(args[6])}
        nbytes = op_bytes(func, args, kwargs, out)
        row["calls"] += 1
        row["flops"] += op_flops(func, args, kwargs, out)
        row["bytes"] += nbytes
        row["call_bytes"][nbytes] = row["call_bytes"].get(nbytes, 0) + 1
        row["seconds"] += seconds


def measure_ops(step, steps: int = 3, network: str | None = None) -> list[dict]:
    """Run ``step`` (warm) ``steps`` times under OpMeter: one row per (phase, layer, op), its
    per-step calls, FLOPs and bytes, and the median over the steps of its seconds."""
    runs = []
    for _ in range(steps):
        with OpMeter(network) as m:
            step()
        runs.append(m.rows)
    rows = []
    for key, row in runs[0].items():
        secs = [r[key]["seconds"] if key in r else 0.0 for r in runs]
        rows.append({**row, "seconds": statistics.median(secs)})
    return rows
