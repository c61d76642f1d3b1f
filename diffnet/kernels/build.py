"""Building and loading the compiled kernels: C source in this folder, compiled with the host's
GCC at first use, cached, and loaded with ctypes into the running process.

A build is keyed by the source, the flags, the compiler's version and the CPU's instruction-set
flags: ``-march=native`` code from one CPU may not run on another (a cluster's home directory is
shared between login and compute nodes of different generations), so each CPU model gets its
own library. The cache is ``$DEEPFUSION_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/deepfusion/
kernels``, else ``~/.cache/deepfusion/kernels``. Ranks that build at once each write a private
file and rename it into place, so a reader never sees half a library.

The library is linked against OpenMP's ``libgomp.so.1`` and loaded after torch, so it shares
torch's OpenMP runtime (torch's wheel ships that library under the same soname): one thread
pool, not two fighting over the cores. Only GCC is used for that reason: clang's ``-fopenmp``
links LLVM's runtime instead.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp before ours, so ours binds to it)

HERE = Path(__file__).resolve().parent
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno")
FIX = ("install GCC (Debian/Ubuntu: apt install gcc; a cluster: module load gcc) or point CC "
       "at it, or set train.fused_kernels = false")


class KernelUnavailable(RuntimeError):
    """The compiled kernels cannot be built or loaded here; the message says why and the fix."""


def compiler() -> str:
    """The GCC to build with: ``$CC`` if set, else ``gcc`` on PATH. Raises KernelUnavailable
    when there is none, or when it is not GCC."""
    cc = os.environ.get("CC") or shutil.which("gcc")
    if not cc:
        raise KernelUnavailable(f"the fused kernels need a C compiler and none was found (no "
                                f"$CC, no gcc on PATH); {FIX}")
    version = compiler_version(cc)
    if "gcc" not in version.lower() and "free software foundation" not in version.lower():
        raise KernelUnavailable(f"the fused kernels are built with GCC (they share torch's GNU "
                                f"OpenMP runtime), but CC={cc} says {version.splitlines()[0]!r}; "
                                f"{FIX}")
    return cc


@functools.cache
def compiler_version(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"cannot run the C compiler {cc!r} ({e}); {FIX}") from None
    return out.stdout.strip() or out.stderr.strip()


def cpu_flags() -> str:
    """The CPU's instruction-set flags (what -march=native compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_dir() -> Path:
    env = os.environ.get("DEEPFUSION_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "deepfusion" / "kernels"


def library_path(name: str, cc: str) -> Path:
    """Where the build of ``name``.c for this compiler, these flags and this CPU lives."""
    key = hashlib.sha256()
    for part in ((HERE / f"{name}.c").read_bytes(), " ".join(FLAGS).encode(),
                 compiler_version(cc).encode(), cpu_flags().encode(), platform.machine().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"


def build(name: str, cc: str, target: Path) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KernelUnavailable(f"cannot create the kernel cache {target.parent} ({e}); set "
                                f"DEEPFUSION_KERNEL_CACHE to a writable directory") from None
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(fd)
    try:
        out = subprocess.run([cc, *FLAGS, "-o", tmp, str(HERE / f"{name}.c")],
                             capture_output=True, text=True, timeout=600)
        if out.returncode:
            raise KernelUnavailable(f"{cc} could not build {name}.c (exit {out.returncode}): "
                                    f"{out.stderr.strip()[-800:]}; {FIX}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load(name: str) -> ctypes.CDLL:
    """The compiled library ``name`` (built on first use, then from the cache)."""
    cc = compiler()
    path = library_path(name, cc)
    if not path.exists():
        build(name, cc, path)
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelUnavailable(f"cannot load the kernel library {path} ({e}); delete it to "
                                f"rebuild, or {FIX}") from None


def describe(name: str) -> str:
    """One line for the start-up log: which library and compiler."""
    cc = compiler()
    return (f"{library_path(name, cc)} ({compiler_version(cc).splitlines()[0]}, "
            f"{' '.join(FLAGS[:2])})")
