"""How the process's C allocator treats freed memory: kept for reuse, or returned to the OS.

A training step allocates and frees the same large activation buffers every step. glibc's
malloc serves blocks above its mmap threshold (a few MB, growing to 32 MB) with fresh mmap()s
and unmaps them when freed, so every step faults every page of its activations in again: on
large grids a large share of the step is system time. With ``parallel.reuse_memory`` (on by
default without a domain split) large blocks come from the heap and freed memory is not
trimmed, so the pages stay mapped across steps: no system time, for more peak memory. Off by
default under a split: a split exists to save memory, and the extra peak per rank can make a
step that fits without it fail for memory. ``python -m bench.domain_bench --parts p1 --size
1024``, with and without ``--malloc-default``, measures both sides (figures:
lab/notes/readme-second-release.md, "freed memory is kept for the next step"). mallopt() at
run time does what the GLIBC_TUNABLES variable would do at start-up, without re-executing the
process.

Also here: the process's peak resident memory (``peak_rss_mib``), which ``infer`` and ``solve``
report per rank so a user can size a split (``--domain``) or a batch for the next run.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import resource

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
NEVER_TRIM = 2**31 - 1  # the largest int mallopt takes: trim only above 2 GiB of free top


def reuse_freed_memory(on: bool) -> str:
    """Keep freed memory in the process (``on``) or leave glibc's defaults; returns a note
    for the layout report ("" when there is nothing to say)."""
    if not on:
        return ""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to set
        return "parallel.reuse_memory: this C library has no mallopt; left as it is"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, NEVER_TRIM)):
        return "parallel.reuse_memory: mallopt refused the settings; left as they are"
    return ""


def proc_status_mib(field: str) -> float | None:
    """A kB field of /proc/self/status (e.g. VmHWM, VmRSS) in MiB; None where unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def peak_rss_mib() -> float:
    """High-water mark of this process's resident set in MiB: VmHWM of /proc/self/status,
    else ``getrusage``'s ru_maxrss (KiB on Linux)."""
    hwm = proc_status_mib("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
