"""parallel.reuse_memory: freed large blocks stay mapped, so the next step does not fault its
pages in again (counted in minor page faults, not timed); the peak resident memory infer reports."""
import subprocess
import sys

import pytest

from tests.mpi_util import ROOT

PROBE = """
import resource, sys
from deepfusion.engine.parallel.memory import reuse_freed_memory
assert reuse_freed_memory(sys.argv[1] == "1") == ""
import ctypes, ctypes.util
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
n = 64 * 2**20
def faults_of_a_step():                # a 64 MiB activation: allocated, written, freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    ptr = libc.malloc(n)
    ctypes.memset(ptr, 1, n)
    libc.free(ptr)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_a_step()                     # the first step maps its pages either way
print(min(faults_of_a_step() for _ in range(3)))
"""


def faults(reuse: bool) -> int:
    p = subprocess.run([sys.executable, "-c", PROBE, "1" if reuse else "0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return int(p.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_freed_memory_is_reused_instead_of_faulted_in_again():
    pages = 64 * 2**20 // 4096
    assert faults(False) > pages // 2      # glibc's default: unmapped when freed, faulted again
    assert faults(True) < pages // 20      # kept: the second step touches mapped pages


PEAK_PROBE = """
import numpy as np
from deepfusion.engine.parallel.memory import peak_rss_mib
before = peak_rss_mib()
a = np.ones(96 * 2**20 // 8)          # 96 MiB, every page written
touched = peak_rss_mib()
del a
print(before, touched, peak_rss_mib())
"""


def test_peak_rss_is_the_high_water_mark_in_mib():
    """peak_rss_mib (what infer/solve report per rank) rises by what was touched, in MiB, and
    stays up after the memory is freed. In a fresh process: the suite's own process has long
    passed any mark a test could set."""
    out = subprocess.run([sys.executable, "-c", PEAK_PROBE], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    before, touched, after = map(float, out.split())
    assert touched - before > 64, (before, touched)
    # the kernel batches RSS counters per thread (a few MiB), so the mark is read with slack
    assert after > touched - 8, (touched, after)
