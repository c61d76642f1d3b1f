"""Shared helpers of the training-step benchmarks (bench/run.py and its parts).

Every timing is a median of interleaved repeats (configurations take turns, so a burst of load
from other jobs on the machine hits them all alike), and every result records the machine load
(``os.getloadavg``) around it. Wall time and process CPU time are both kept: on a shared machine
the CPU time of a single-threaded process is the load-robust measure of the work done.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time

from deepfusion.engine.parallel.memory import peak_rss_mib as peak_rss_mb  # noqa: F401 (the benches' name)
from deepfusion.engine.parallel.memory import proc_status_mib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def machine() -> dict:
    import torch

    flags = cpu_flags()
    return {"cores": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
            "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "isa": sorted(f for f in flags if f.startswith(("avx", "amx", "fma"))),
            "loadavg": load()}


def median(xs) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def median_seconds(fn, repeats: int) -> float:
    """Median wall seconds of ``repeats`` calls of fn, after one untimed warm-up call (oneDNN
    primitive creation, first-touch allocations)."""
    fn()
    return median(wall_seconds(fn, repeats))


def wall_seconds(fn, n: int) -> list[float]:
    """Wall seconds of each of ``n`` calls of fn, one after the other (no warm-up)."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def rss_mb() -> float:
    """This process's resident set now (VmRSS), in MiB; nan where unavailable."""
    rss = proc_status_mib("VmRSS")
    return rss if rss is not None else float("nan")


def command_line(prog: str, argv=None) -> str:
    """The command that reproduces this run, as a result file records it: ``prog`` and the
    arguments (``argv`` when main was called in-process, else this process's own)."""
    return " ".join([prog] + list(sys.argv[1:] if argv is None else argv))


def emit_json(res: dict, out: str | None) -> None:
    """A benchmark's result: to ``out`` if given (directories created), else to stdout."""
    text = json.dumps(res, indent=1)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(text)
        print(f"-> {out}")
    else:
        print(text)


class Timer:
    """Wall and process-CPU seconds of a block."""

    def __enter__(self):
        self.w0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.w0
        self.cpu = time.process_time() - self.c0


def gemm_seconds(n: int = 2048):
    """One timed torch.mm of two n x n fp32 matrices (inputs cached between calls)."""
    import torch

    key = ("gemm", n)
    if key not in _CACHE:
        g = torch.Generator().manual_seed(0)
        _CACHE[key] = (torch.randn(n, n, generator=g), torch.randn(n, n, generator=g),
                       torch.empty(n, n))
    a, b, out = _CACHE[key]
    with Timer() as t:
        torch.mm(a, b, out=out)
    return t


_CACHE: dict = {}


def gemm_flops(n: int) -> float:
    return 2.0 * n ** 3


def build(problem: str = "burgers", grid: int = 64, generator: str = "unet",
          model_options: dict | None = None, channels_last: bool = True, seed: int = 0):
    """(task, model) as deepfusion.app.build builds them (float32), on the grid of ``grid``
    nodes along each of the problem's axes (N x N, or N x N x N for a 3-D problem)."""
    import torch

    from deepfusion.engine.parallel.memformat import convert_model
    from diffnet.generators import build_generator
    from diffnet.problems import PROBLEMS, get_problem

    task = get_problem(problem, grid=(grid,) * PROBLEMS[problem].dims)
    torch.manual_seed(seed)
    model = build_generator(generator, in_channels=len(task.input_channels),
                            **(model_options or {})).float()
    return task, convert_model(model, channels_last)


def fused(model):
    """``model`` with the compiled kernels (train.fused_kernels), or None with the reason
    printed where this host cannot build them (the fused rows are then left out)."""
    from diffnet.kernels import KernelUnavailable, fuse

    try:
        fuse(model)
    except KernelUnavailable as e:
        print(f"  no fused rows: {e}", flush=True)
        return None
    return model


def inputs(task, batch: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    lo_hi = task.param_bounds()
    params = rng.uniform(lo_hi[:, 0], lo_hi[:, 1], size=(batch, lo_hi.shape[0]))
    return task.build_input(params)


def step_flops(model, task, x) -> float:
    """FLOPs of one forward + backward (torch.utils.flop_counter: convolutions and matmuls)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        u = task.answer(model(x), x)
        terms = task.loss_terms(u, x)
        sum(t.sum() for t in terms.values()).backward()
    model.zero_grad(set_to_none=True)
    return float(fc.get_total_flops())


def run_json(cmd: list[str], *, timeout: float = 900, env: dict | None = None) -> dict:
    """Run a worker that prints one JSON line (its last stdout line) and return it."""
    e = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    e.update(env or {})
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e, cwd=ROOT)
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"error": f"exit {p.returncode}: {p.stderr.strip()[-800:]}"}
    return json.loads(lines[-1])


def mpiexec() -> str:
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(local):
        return local
    import shutil

    return shutil.which("mpiexec") or "mpiexec"


def mpi_cmd(n: int, module: str, args: list[str]) -> list[str]:
    return [mpiexec(), "-n", str(n), sys.executable, "-m", module] + args
