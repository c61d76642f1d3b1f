"""Stop requests: SIGTERM and SIGUSR1 (Slurm's time-limit warning, ``--signal=B:USR1@N``).

The handler only records the request; the trainer puts it in the next step's fused allreduce,
so every rank stops after the same step, writes a checkpoint and exits 99. It is installed when
the train command starts, before MPI and torch are loaded, so a signal that arrives during
start-up (a short time limit, a job cancelled while it loads) is kept for the first step instead
of killing the rank with the default action.
"""
from __future__ import annotations

import signal

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_requested = False


def _handler(signum, frame):
    global _requested
    _requested = True


def install() -> None:
    """Catch the stop signals from now on (idempotent)."""
    for sig in SIGNALS:
        signal.signal(sig, _handler)


def requested() -> bool:
    return _requested

