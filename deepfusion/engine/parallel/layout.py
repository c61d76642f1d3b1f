"""Hybrid MPI + threads: how many oneDNN/OpenMP threads each rank runs, and the layout report.

Must run before the first torch operation: OpenMP reads OMP_NUM_THREADS once, when its pool
starts. Launchers such as MPICH's hydra do not bind by default, so every rank sees every core
in its affinity mask; the default therefore divides the host's cores by the number of ranks on
that host (found with a shared-memory split of the communicator) and never exceeds the rank's
own affinity.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from deepfusion.engine.parallel.comm import Communicator, hostname


@dataclass
class RankLayout:
    rank: int
    local_rank: int
    local_size: int
    host: str
    host_cores: int
    affinity: list[int]
    threads: int
    load: float = 0.0   # the host's 1-minute load average when the rank started


def load_average() -> float:
    """The host's 1-minute load average (0 where the OS does not report one)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def affinity() -> list[int]:
    """CPUs this process may run on (all CPUs where the OS has no affinity call)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return list(range(os.cpu_count() or 1))


def default_threads(host_cores: int, local_size: int, n_affinity: int) -> int:
    """Cores of the host shared out among its ranks, capped by the rank's affinity mask."""
    return max(1, min(n_affinity, host_cores // max(1, local_size)))


def setup_threads(comm: Communicator, requested: int = 0) -> tuple[RankLayout, Communicator]:
    """Decide threads per rank, set OMP_NUM_THREADS and torch's pools; return the layout."""
    node = comm.split_node()
    aff = affinity()
    host_cores = os.cpu_count() or len(aff)
    threads = requested if requested > 0 else default_threads(host_cores, node.size, len(aff))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ.setdefault("MKL_NUM_THREADS", str(threads))
    import torch  # first import after OMP_NUM_THREADS is set

    torch.set_num_threads(threads)
    limit_blas(threads)
    try:
        torch.set_num_interop_threads(1)  # one model per rank: inter-op parallelism only oversubscribes
    except RuntimeError:
        pass  # already set (a second run in the same process, e.g. tests)
    layout = RankLayout(comm.rank, node.rank, node.size, hostname(), host_cores, aff, threads,
                        load_average())
    return layout, node


def limit_blas(threads: int) -> None:
    """Cap the BLAS libraries already loaded (numpy's and scipy's OpenBLAS) at ``threads``.

    A BLAS reads OMP_NUM_THREADS only when it loads, and the communicator's module has loaded
    numpy before the layout is known: without this, numpy's OpenBLAS runs one thread per core
    in every rank (a reference AMG solve at ``--threads 1`` uses more than one core),
    oversubscribing the node under ``mpiexec``. Libraries loaded later read OMP_NUM_THREADS,
    which is set by now.
    """
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=threads, user_api="blas")


def _ranges(cpus: list[int]) -> str:
    """Compact CPU list: [0,1,2,5] -> '0-2,5'."""
    out, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            out.append(f"{start}" if start == c else f"{start}-{c}")
            start = None
    return ",".join(out)


def report(layouts: list[RankLayout], mpi_version: str) -> tuple[str, list[str]]:
    """The start-up layout table and warnings (oversubscribed hosts, ranks bound to fewer CPUs
    than their threads), each naming the fix that applies."""
    hosts = sorted({l.host for l in layouts})
    lines = [f"layout: {len(layouts)} rank(s) on {len(hosts)} host(s), "
             f"threads per rank {sorted({l.threads for l in layouts})}; MPI: {mpi_version}"]
    for l in layouts:
        lines.append(f"  rank {l.rank:>4} local_rank {l.local_rank:>3} host {l.host} "
                     f"threads {l.threads} affinity {_ranges(l.affinity)}")
    warnings = [w for h in hosts
                for w in (host_warning(h, [l for l in layouts if l.host == h]),
                          busy_warning(h, [l for l in layouts if l.host == h])) if w]
    warnings += affinity_warnings(layouts)
    return "\n".join(lines), warnings


def host_warning(host: str, on: list[RankLayout]) -> str:
    """The warning for a host whose ranks run more threads than it has cores, naming the fix
    that applies: fewer threads per rank while that suffices, else fewer ranks on the host
    (at one thread per rank, more ranks than cores oversubscribe whatever the setting)."""
    cores, used = on[0].host_cores, sum(l.threads for l in on)
    if used <= cores:
        return ""
    if len(on) <= cores:
        fix = f"set parallel.threads_per_rank = {cores // len(on)}"
    else:
        fix = (f"more ranks than cores even at one thread each: start at most {cores} ranks "
               f"on this host (mpiexec -ppn {cores}, srun --ntasks-per-node={cores}) or more "
               f"hosts")
        if max(l.threads for l in on) > 1:
            fix += ", with parallel.threads_per_rank = 1"
    return (f"host {host}: {len(on)} ranks x threads = {used} threads on {cores} cores "
            f"(oversubscribed: expect slow steps; {fix})")


def busy_warning(host: str, on: list[RankLayout]) -> str:
    """The warning for a host already busy when the job started (its load average at least its
    cores) where ranks run several threads: OpenMP threads spin-wait for each other at every
    parallel region, so a thread that loses its core to another process holds up the rest and
    a step can take several times longer than the same threads on free cores. Passive waiting
    (OMP_WAIT_POLICY=PASSIVE) avoids that but costs every step on a free host."""
    cores, load = on[0].host_cores, max(l.load for l in on)
    if load < cores or max(l.threads for l in on) < 2:
        return ""
    return (f"host {host}: load average {load:.1f} on {cores} cores before this job: other "
            f"processes take cores, and threads that wait for each other then slow every step "
            f"several-fold; run on free cores (a batch job's own cores), or set "
            f"parallel.threads_per_rank = 1, or export OMP_WAIT_POLICY=PASSIVE (slower on a "
            f"free host; docs/performance.md)")


def affinity_warnings(layouts: list[RankLayout]) -> list[str]:
    """One warning per kind of rank bound to fewer CPUs than it runs threads (its threads share
    them), naming the ranks: a large job bound one way prints one line, not one per rank."""
    kinds: dict[tuple[int, int], list[RankLayout]] = {}
    for l in layouts:
        if l.threads > len(l.affinity):
            kinds.setdefault((l.threads, len(l.affinity)), []).append(l)
    out = []
    for (threads, cpus), ls in sorted(kinds.items()):
        ranks = ", ".join(str(l.rank) for l in ls[:8]) + (f" and {len(ls) - 8} more"
                                                          if len(ls) > 8 else "")
        out.append(f"rank {ranks}: {threads} threads on the {cpus} CPU(s) its affinity allows "
                   f"(rank {ls[0].rank}: {_ranges(ls[0].affinity)}): set "
                   f"parallel.threads_per_rank = {cpus}, or bind each rank to {threads} cores "
                   f"(srun --cpus-per-task={threads}, mpiexec -bind-to core:{threads})")
    return out


BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def bf16_flags(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """The native bf16 flags (AVX512-BF16, AMX-BF16) that /proc/cpuinfo lists for this CPU."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [flag for flag in BF16_FLAGS if flag in have]
    except OSError:
        pass
    return []


def bf16_supported(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True if the CPU has native bf16 arithmetic (AVX512-BF16 or AMX-BF16) per /proc/cpuinfo.

    Without them PyTorch does not send bf16 convolutions to oneDNN but to its generic im2col
    path (``aten::_slow_conv2d_forward`` in a profile), and a bf16 training step runs an order
    of magnitude slower than fp32 (``python -m bench.step_bench --bf16 --grids 64:16 --threads
    1`` and ``python -m bench.conv_rate --bf16`` measure it on a given CPU; figures:
    lab/notes/performance.md).
    """
    return bool(bf16_flags(cpuinfo))


def agreed_precision(requested: str, comm, cpuinfo: str = "/proc/cpuinfo") -> str:
    """The precision the run computes in: ``requested``, but "auto" becomes "bf16" only if every
    rank's CPU has native bf16, else "fp32". Collective for "auto": ranks on different node
    types (a requeue, a mixed partition) take the same branch, so no rank runs the other's step."""
    if requested != "auto":
        return requested
    return "bf16" if all(comm.allgather_obj(bf16_supported(cpuinfo))) else "fp32"


def precision_line(precision: str, cpuinfo: str = "/proc/cpuinfo", *, requested: str = "") -> str:
    """The start-up line on the step's precision and what this CPU offers; ``requested`` =
    "auto" says what auto chose and why."""
    flags = bf16_flags(cpuinfo)
    if requested == "auto":
        why = (f"every rank's CPU has native bf16; here {', '.join(flags)}" if precision == "bf16"
               else "not every rank's CPU has avx512_bf16 or amx_bf16")
        return f"precision: auto -> {precision} ({why})"
    if precision == "bf16":
        return (f"precision: bf16 (the generator under bf16 autocast, loss and optimizer in "
                f"fp32; CPU: {', '.join(flags)})")
    if flags:
        return (f"precision: fp32; this CPU has {', '.join(flags)}: train.precision = \"bf16\" "
                f"runs the step faster (docs/performance.md)")
    return "precision: fp32 (this CPU has no avx512_bf16 or amx_bf16, so no bf16 path)"


AMX_FREE_ISA = "AVX512_CORE_BF16"   # oneDNN's ISA cap: AVX-512 bf16 instructions, no AMX


def avoid_amx_under_a_split(cpuinfo: str = "/proc/cpuinfo") -> str:
    """Cap oneDNN below AMX for a bf16 model on a split domain, and the note saying so ("" when
    nothing changes: no AMX, or ONEDNN_MAX_CPU_ISA set by the user). Why: on AMX hosts the
    split bf16 prediction came out 20% off the undivided one while capped at AVX512_CORE_BF16
    it is within bf16 rounding (0.3%), as it is undivided with AMX (``tests/test_domain_train.py``,
    the bf16 split test); the cause inside oneDNN's AMX kernels is not found. Must run before the
    process's first bf16 convolution: oneDNN reads the variable once, at its first use."""
    flags = bf16_flags(cpuinfo)
    if "amx_bf16" not in flags or "ONEDNN_MAX_CPU_ISA" in os.environ:
        return ""
    os.environ["ONEDNN_MAX_CPU_ISA"] = AMX_FREE_ISA
    return (f"note: bf16 on a split domain runs oneDNN without AMX on this CPU "
            f"(ONEDNN_MAX_CPU_ISA={AMX_FREE_ISA}): its AMX kernels gave wrong split answers "
            f"here; set ONEDNN_MAX_CPU_ISA yourself to choose")


def check_precision(precision: str, cpuinfo: str = "/proc/cpuinfo", *,
                    setting: str = "train.precision = \"{}\"") -> None:
    """Refuse bf16 with a clear message on CPUs without native bf16 kernels. ``setting`` is how
    the user asked for a precision ({} is the value), so the message names what to change."""
    if precision == "bf16" and not bf16_supported(cpuinfo):
        raise ValueError(
            f"{setting.format('bf16')} needs a CPU with avx512_bf16 or amx_bf16 (see the flags "
            "in /proc/cpuinfo); this CPU has neither, so PyTorch would run bf16 convolutions "
            "outside oneDNN and the network would run many times slower than in fp32. "
            f"Use {setting.format('fp32')}.")
