"""Sealed files: a file's bytes followed by a trailer that holds their sha256, checked before
anything parses the file; and the contained check of a file that has no trailer.

The trailer (:data:`TRAILER_SIZE` = 92 bytes) is appended once the file is written and closed::

    b"\\n#deepfusion-sealed sha256=" + 64 lowercase hex digits + b"\\n"

and covers every byte before it. Nothing inside the covered bytes records the digest, so the
digest is of the file exactly as its writer closed it. HDF5 ignores bytes after its end of file,
so a sealed HDF5 file still opens in h5py, h5ls or h5dump; a shell checks one with
``head -c -92 FILE | sha256sum`` against ``tail -c 65 FILE``.

Checking is hashing only (no parser, no library that could loop or crash on damaged
structure): :func:`read_sealed` reads the file into memory and checks it, so what was checked
is what the caller then parses; :func:`check_sealed` streams it (no memory). A file whose last
bytes are no trailer is *unsealed* (written before files were sealed, cut short, or with a
damaged trailer): only its reader can tell which, and a damaged file can hang or crash a parser,
so :func:`run_contained` runs such a check in a child process, where a hang ends at a timeout
and a crash ends only the child.

Plain ``hashlib`` and ``subprocess``: no HDF5, no torch, no MPI.
"""
from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys

MAGIC = b"\n#deepfusion-sealed sha256="
TRAILER_SIZE = len(MAGIC) + 64 + 1
_HEX = re.compile(rb"[0-9a-f]{64}")
_CHUNK = 1 << 22


class SealBroken(ValueError):
    """A sealed file whose bytes do not match its trailer, or whose trailer is damaged."""


class ChildFailed(RuntimeError):
    """A contained check that crashed or hung (the child was killed)."""


def trailer(hexdigest: str) -> bytes:
    """The trailer recording ``hexdigest``."""
    return MAGIC + hexdigest.encode("ascii") + b"\n"


def recorded_digest(tail: bytes) -> str | None:
    """The digest in ``tail`` (a file's last :data:`TRAILER_SIZE` bytes); None when those bytes
    are no trailer (an unsealed file); :class:`SealBroken` when they are a damaged one (its
    marker within a few bits of :data:`MAGIC`)."""
    if len(tail) < TRAILER_SIZE:
        return None
    head, digits = tail[:len(MAGIC)], tail[len(MAGIC):-1]
    # a few flipped bits from the marker: a damaged trailer, not the bytes of an unsealed file
    near = sum(bin(a ^ b).count("1") for a, b in zip(head, MAGIC)) <= 4
    if not near:
        return None
    if head != MAGIC or tail[-1:] != b"\n" or not _HEX.fullmatch(digits):
        raise SealBroken("its whole-file digest (the trailer after the HDF5 data) is damaged")
    return digits.decode("ascii")


def _mismatch() -> SealBroken:
    return SealBroken("its bytes do not match the whole-file digest recorded when it was "
                      "written (changed since: a disk or copy error?)")


def seal(path) -> str:
    """Append the trailer to the closed file ``path``; returns the digest."""
    h = hashlib.sha256()
    with open(path, "r+b") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
        fh.seek(0, os.SEEK_END)
        fh.write(trailer(h.hexdigest()))
    return h.hexdigest()


def read_sealed(path) -> tuple[bytes, bool]:
    """(the bytes of ``path``, whether it is sealed), checked: :class:`SealBroken` if it is
    sealed and they differ from the digest it records. The bytes include the trailer."""
    with open(path, "rb") as fh:
        data = fh.read()
    recorded = recorded_digest(data[-TRAILER_SIZE:])
    if recorded is None:
        return data, False
    if hashlib.sha256(memoryview(data)[:-TRAILER_SIZE]).hexdigest() != recorded:
        raise _mismatch()
    return data, True


def check_sealed(path) -> bool:
    """Whether ``path`` is sealed (True, and intact) or unsealed (False), streaming it (no
    copy in memory); :class:`SealBroken` if it is sealed and its bytes differ."""
    with open(path, "rb") as fh:
        size = fh.seek(0, os.SEEK_END)
        fh.seek(max(0, size - TRAILER_SIZE))
        recorded = recorded_digest(fh.read())
        if recorded is None:
            return False
        fh.seek(0)
        h, left = hashlib.sha256(), size - TRAILER_SIZE
        while left > 0:
            chunk = fh.read(min(_CHUNK, left))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
    if h.hexdigest() != recorded:
        raise _mismatch()
    return True


def sha256_hex(data) -> str:
    return hashlib.sha256(data).hexdigest()


def child_env() -> dict:
    """The environment of a contained check: this interpreter's packages, one thread."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.environ.get("PYTHONPATH", "")
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                PYTHONPATH=root + (os.pathsep + path if path else ""))


def run_contained(args: list[str], timeout: float) -> str:
    """The last line a child ``python ARGS...`` prints on stdout when it exits 0.

    A child that runs past ``timeout`` seconds is killed and :class:`ChildFailed` says it hung;
    one killed by a signal (a segfault in a native library) or exiting non-zero raises
    :class:`ChildFailed` naming that. Either way this process goes on."""
    try:
        p = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                           timeout=timeout, env=child_env(), stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:  # run() has killed the child
        raise ChildFailed(f"reading it did not finish within {timeout:g} s (a damaged "
                          f"structure that makes the reader loop?)") from None
    if p.returncode < 0:
        try:
            name = signal.Signals(-p.returncode).name
        except ValueError:
            name = f"signal {-p.returncode}"
        raise ChildFailed(f"reading it crashed the reader ({name})")
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines:
        err = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise ChildFailed(f"the check exited with code {p.returncode} ({err})")
    return lines[-1]


__all__ = ["MAGIC", "TRAILER_SIZE", "ChildFailed", "SealBroken", "check_sealed", "child_env",
           "read_sealed", "recorded_digest", "run_contained", "seal", "sha256_hex", "trailer"]
