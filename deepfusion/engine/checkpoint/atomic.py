"""Publishing a file atomically, and cleaning up after writers that were killed.

A writer never writes its output name directly: it writes ``<path>.tmp.<pid>``, and only once
the temp file is closed is it fsync'ed, ``os.replace``'d onto ``path`` and the directory
fsync'ed, so ``path`` is either the old file, or the new one complete and on disk; never half
of one. On any error the temp file is removed.

Two shapes of the same thing:

* :func:`atomic_path`: a context manager for a file written in one go (checkpoints);
* :class:`Staged`: ``publish()`` / ``discard()`` for a file filled over many calls (the fields
  files of ``deepfusion infer`` and ``deepfusion solve``).

A writer killed outright (SIGKILL, node failure) leaves its ``.tmp.<pid>`` file behind;
:func:`remove_stale_temps` removes those of processes that no longer exist.

Used by :mod:`deepfusion.engine.checkpoint.store` and :mod:`deepfusion.app.fields_file`. Plain ``os``: no
HDF5, no MPI (the caller decides which rank writes).
"""
from __future__ import annotations

import contextlib
import os
import re

_TEMP = re.compile(r"^(?P<base>.+)\.tmp\.(?P<pid>\d+)$")


def temp_path(path) -> str:
    """This process's temp name for ``path``: ``<path>.tmp.<pid>``."""
    return f"{os.fspath(path)}.tmp.{os.getpid()}"


def fsync_path(path: str, directory: bool = False) -> None:
    """Flush ``path`` (a closed file, or a directory's entries) to the disk.

    Directories: some platforms and filesystems cannot open or fsync them; the rename is then
    as durable as that filesystem makes it, so those errors are ignored. A file that cannot be
    fsync'ed is an error (its data may not be on disk)."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path or ".", flags)
    except OSError:
        if directory:
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not directory:
            raise
    finally:
        os.close(fd)


class Staged:
    """``path`` being written under :func:`temp_path`: write ``self.tmp``, close it, then
    :meth:`publish`; on failure :meth:`discard` (``path`` is left untouched)."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self.tmp = temp_path(self.path)

    def publish(self) -> str:
        """fsync the (closed) temp file, rename it onto ``path``, fsync the directory."""
        fsync_path(self.tmp)
        os.replace(self.tmp, self.path)
        fsync_path(os.path.dirname(os.path.abspath(self.path)), directory=True)
        return self.path

    def discard(self) -> None:
        try:
            os.remove(self.tmp)
        except OSError:  # never created, or already gone
            pass


@contextlib.contextmanager
def atomic_path(path):
    """``with atomic_path(p) as tmp:`` write and close ``tmp``; on leaving the block without an
    exception it is published onto ``p`` (see :class:`Staged`), on any exception (or a failed
    publish) it is removed and the exception goes on."""
    staged = Staged(path)
    try:
        yield staged.tmp
        staged.publish()
    except BaseException:
        staged.discard()
        raise


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (signal 0 probes without signalling)."""
    if pid <= 0:  # 0 and negatives address process groups, never a writer
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OverflowError, ValueError):  # not a PID this system can have
        return False
    except OSError:  # e.g. PermissionError: it exists, owned by someone else
        return True
    return True


def remove_stale_temps(directory, base: re.Pattern | None = None) -> list[str]:
    """Remove the ``<name>.tmp.<pid>`` files in ``directory`` (with ``<name>`` matching ``base``
    when given) left by writers that were killed; return their paths.

    Stale means: not this process's, and no process with that PID exists on this host. The
    liveness test keeps the temp file of a concurrent writer on this host (never deleted
    mid-write); on a filesystem shared between nodes a PID from another node is judged by this
    host's process table, so an unrelated live process with the same number only delays the
    removal until a later call (costing disk space, never data)."""
    directory = os.fspath(directory)
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in sorted(names):
        m = _TEMP.match(name)
        if not m or (base is not None and not base.match(m["base"])):
            continue
        pid = int(m["pid"])
        if pid == os.getpid() or pid_alive(pid):
            continue
        path = os.path.join(directory, name)
        try:
            os.remove(path)
            removed.append(path)
        except FileNotFoundError:  # removed meanwhile by someone else
            pass
    return removed


__all__ = ["Staged", "atomic_path", "fsync_path", "pid_alive", "remove_stale_temps",
           "temp_path"]
