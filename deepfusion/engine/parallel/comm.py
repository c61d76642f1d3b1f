"""The communicator: the one place that talks MPI.

Small on purpose: rank, size, in-place allreduce (blocking and not), broadcast, gather,
barrier, abort, the two buffer calls domain parallelism needs (``sendrecv_`` for halo
exchange, ``allgather_`` of equal pieces), and ``split`` so sub-communicators (domain
parallelism, node-local groups) are the same abstraction. ``MPIComm`` wraps an mpi4py
communicator; ``SerialComm`` is the P=1 stand-in used when mpi4py is missing or
``DEEPFUSION_NO_MPI=1``.

Buffers are numpy arrays or CPU torch tensors; a tensor is passed to MPI as a numpy *view*
(``tensor.numpy()`` shares memory), so no bytes are copied between torch and MPI.
"""
from __future__ import annotations

import os
import socket
import sys
import time

import numpy as np

ABORT_GRACE_S = 0.5  # seconds between a rank's last message and MPI_Abort


def as_buffer(buf, reduce: bool = False) -> np.ndarray:
    """A zero-copy numpy view of a contiguous CPU tensor or array (asserted, never copied).

    numpy has no bfloat16: a bfloat16 tensor that only moves (send, receive, broadcast, gather)
    travels as its int16 bit pattern, exactly; one that would be reduced (``reduce``) is refused,
    since MPI would add the bit patterns as integers."""
    if hasattr(buf, "detach") and hasattr(buf, "numpy"):
        if not buf.is_contiguous():
            raise ValueError("communication buffers must be contiguous tensors")
        import torch  # buf is a tensor, so torch is loaded already

        buf = buf.detach()
        if buf.dtype == torch.bfloat16:
            if reduce:
                raise ValueError("MPI cannot reduce bfloat16 buffers: reduce in float32")
            buf = buf.view(torch.int16)
        view = buf.numpy()
    else:
        view = buf
    if not (isinstance(view, np.ndarray) and view.flags.c_contiguous):
        raise ValueError("communication buffers must be C-contiguous numpy arrays or tensors")
    return view


class _DoneRequest:
    """A completed request (the serial communicator's non-blocking calls finish at once)."""

    def wait(self):
        return None

    def Test(self) -> bool:  # noqa: N802 (mpi4py's name: requests of both kinds are alike)
        return True


class Communicator:
    """Interface shared by the MPI and serial communicators."""

    rank: int = 0
    size: int = 1

    def allreduce_(self, buf, op: str = "sum"):
        """Reduce ``buf`` over all ranks in place (every rank gets the result)."""
        raise NotImplementedError

    def iallreduce_(self, buf, op: str = "sum"):
        """Start an in-place allreduce; returns a request whose ``wait()`` completes it and
        whose ``Test()`` progresses it (True once complete)."""
        raise NotImplementedError

    def bcast_(self, buf, root: int = 0):
        """Broadcast ``buf`` from ``root`` in place."""
        raise NotImplementedError

    def sendrecv_(self, sendbuf, dest: int | None, recvbuf, source: int | None, tag: int = 0):
        """Blocking point-to-point exchange (MPI Sendrecv): send ``sendbuf`` to rank ``dest``
        while receiving ``recvbuf`` (same element type; filled in place) from rank ``source``.
        ``dest`` / ``source`` None mean MPI.PROC_NULL: nothing sent / nothing received (then
        the matching buffer is ignored and may be None). A shift along a chain of ranks is
        deadlock-free because every rank sends and receives in the same call."""
        raise NotImplementedError

    def allgather_(self, sendbuf, recvbuf):
        """Every rank's ``sendbuf`` (equal sizes) into ``recvbuf`` (size times as many
        elements), in rank order."""
        raise NotImplementedError

    def bcast_obj(self, obj, root: int = 0):
        raise NotImplementedError

    def allgather_obj(self, obj) -> list:
        raise NotImplementedError

    def gather_obj(self, obj, root: int = 0) -> list | None:
        """Every rank's ``obj`` as a list on ``root``; None elsewhere."""
        raise NotImplementedError

    def barrier(self):
        raise NotImplementedError

    def abort(self, code: int = 1):
        raise NotImplementedError

    def split(self, color: int, key: int | None = None) -> "Communicator":
        raise NotImplementedError

    def split_node(self) -> "Communicator":
        """The ranks sharing this rank's node (shared-memory domain)."""
        raise NotImplementedError

    def library_version(self) -> str:
        raise NotImplementedError


class SerialComm(Communicator):
    """One process, no MPI: every collective is the identity."""

    rank, size = 0, 1

    def allreduce_(self, buf, op="sum"):
        as_buffer(buf, reduce=True)
        return buf

    def iallreduce_(self, buf, op="sum"):
        as_buffer(buf, reduce=True)
        return _DoneRequest()

    def bcast_(self, buf, root=0):
        return buf

    def sendrecv_(self, sendbuf, dest, recvbuf, source, tag=0):
        # The only partner is this rank itself, and a send needs its receive: both or neither.
        if dest not in (None, 0) or source not in (None, 0) or (dest is None) != (source is None):
            raise ValueError(f"serial sendrecv_ exchanges with rank 0 (itself) or nobody "
                             f"(None), both ways at once; got dest={dest}, source={source}")
        if dest is not None:
            np.copyto(as_buffer(recvbuf), as_buffer(sendbuf).reshape(as_buffer(recvbuf).shape))
        return recvbuf

    def allgather_(self, sendbuf, recvbuf):
        np.copyto(as_buffer(recvbuf), as_buffer(sendbuf).reshape(as_buffer(recvbuf).shape))
        return recvbuf

    def bcast_obj(self, obj, root=0):
        return obj

    def allgather_obj(self, obj):
        return [obj]

    def gather_obj(self, obj, root=0):
        return [obj]

    def barrier(self):
        return None

    def abort(self, code=1):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def split(self, color, key=None):
        return self

    def split_node(self):
        return self

    def library_version(self):
        return "serial (no MPI)"


class MPIComm(Communicator):
    """mpi4py-backed communicator."""

    def __init__(self, comm=None):
        from mpi4py import MPI

        self._MPI = MPI
        self._comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self._comm.Get_rank()
        self.size = self._comm.Get_size()
        self._ops = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}

    def _op(self, op):
        try:
            return self._ops[op]
        except KeyError:
            raise ValueError(f"unknown reduction op {op!r}; valid: {sorted(self._ops)}") from None

    def allreduce_(self, buf, op="sum"):
        self._comm.Allreduce(self._MPI.IN_PLACE, as_buffer(buf, reduce=True), op=self._op(op))
        return buf

    def iallreduce_(self, buf, op="sum"):
        return self._comm.Iallreduce(self._MPI.IN_PLACE, as_buffer(buf, reduce=True),
                                     op=self._op(op))

    def bcast_(self, buf, root=0):
        self._comm.Bcast(as_buffer(buf), root=root)
        return buf

    def sendrecv_(self, sendbuf, dest, recvbuf, source, tag=0):
        null = self._MPI.PROC_NULL
        self._comm.Sendrecv(None if dest is None else as_buffer(sendbuf),
                            null if dest is None else dest, sendtag=tag,
                            recvbuf=None if source is None else as_buffer(recvbuf),
                            source=null if source is None else source, recvtag=tag)
        return recvbuf

    def allgather_(self, sendbuf, recvbuf):
        self._comm.Allgather(as_buffer(sendbuf), as_buffer(recvbuf))
        return recvbuf

    def bcast_obj(self, obj, root=0):
        return self._comm.bcast(obj, root=root)

    def allgather_obj(self, obj):
        return self._comm.allgather(obj)

    def gather_obj(self, obj, root=0):
        return self._comm.gather(obj, root=root)

    def barrier(self):
        self._comm.Barrier()

    def abort(self, code=1):
        sys.stdout.flush()
        sys.stderr.flush()
        # MPICH's launcher forwards a rank's output through its proxy; Abort tears the proxies
        # down at once, and the dying rank's last message (the reason for the abort) can be
        # lost. A moment's grace lets it through.
        time.sleep(ABORT_GRACE_S)
        self._comm.Abort(code)

    def split(self, color, key=None):
        return MPIComm(self._comm.Split(color, self.rank if key is None else key))

    def split_node(self):
        MPI = self._MPI
        return MPIComm(self._comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank))

    def library_version(self):
        return self._MPI.Get_library_version().strip().splitlines()[0]


def world() -> Communicator:
    """COMM_WORLD if mpi4py is importable (a lone process becomes a singleton MPI job, so no
    launcher is needed at P=1), else the serial communicator."""
    if os.environ.get("DEEPFUSION_NO_MPI", "") == "1":
        return SerialComm()
    try:
        from mpi4py import MPI  # noqa: F401
    except ImportError:
        return SerialComm()
    return MPIComm()


# Environment variables in which launchers announce how many processes they started.
LAUNCHER_SIZES = (("SLURM_STEP_NUM_TASKS", "srun"), ("OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun"),
                  ("PMI_SIZE", "a PMI launcher (MPICH / Intel MPI mpiexec)"))


def launcher_mismatch(comm: Communicator, environ=None) -> str | None:
    """Why this process is a world of 1 although its launcher started several (srun without
    --mpi=pmi2, or an mpiexec of another MPI than mpi4py's): each copy would train alone into
    the same run directory. None when the sizes agree or no launcher said anything."""
    if comm.size != 1:
        return None
    env = os.environ if environ is None else environ
    for var, who in LAUNCHER_SIZES:
        try:
            n = int(env.get(var, "1"))
        except ValueError:
            continue
        if n > 1:
            return (f"{who} started {n} processes ({var}={n}) but MPI sees a world of 1 in "
                    f"each: every copy would train alone. With srun and the pip mpich use "
                    f"srun --mpi=pmi2 (a site MPI: its own pairing, srun --mpi=list); with "
                    f"mpiexec use the one of the MPI mpi4py was built with "
                    f"(python -c 'import mpi4py; print(mpi4py.get_config())')")
    return None


def hostname() -> str:
    return socket.gethostname()
