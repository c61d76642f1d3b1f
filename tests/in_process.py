"""``deepfusion ARGS`` in the test process on the serial communicator (DEEPFUSION_NO_MPI=1), for
module-scoped fixtures (which cannot take the function-scoped ``cli`` fixture) and for the
one-process runs a test compares against rather than tests: each saves a launch, ~2.5 s of
imports. Where the plain process itself is the subject (a lone rank as a singleton MPI job, a
fresh interpreter), the tests launch one with ``tests.mpi_util.deepfusion(0, ...)``.
"""
from __future__ import annotations

import contextlib
import io
import subprocess

import pytest

from deepfusion.cli import main


def deepfusion_here(args: list[str]) -> subprocess.CompletedProcess:
    """Run the command here; the result reads like a launch's (returncode, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        mp.setenv("DEEPFUSION_NO_MPI", "1")
        rc = main(args)
    return subprocess.CompletedProcess(["deepfusion", *args], rc, out.getvalue(), err.getvalue())
