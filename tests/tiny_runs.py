"""Tiny training runs that several test files compare against, trained once per test session.

``trained(tmp_path_factory, config, ranks)`` is the run directory of ``deepfusion train`` of the
TOML text ``config`` on ``ranks`` processes (0: one plain process, no launcher). The first
caller trains it; every later caller, in any pytest-xdist worker of the same session, reads the
same directory: the uninterrupted tiny run that the resume, rollback and layout tests compare
their losses with is trained once, not once per file (each launch costs every rank ~2 s of
imports). A run found here is for reading: a test that resumes it, evaluates into it or damages
it works on a copy (``shutil.copytree``).
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import pathlib

from tests.mpi_util import REAL_MPI, deepfusion


def session_dir(tmp_path_factory) -> pathlib.Path:
    """A directory of this session that every worker sees: the workers' base temporary
    directories share their parent (under xdist), one process has its own base directory."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def trained(tmp_path_factory, config: str, ranks: int) -> str:
    """The run directory of ``config`` trained on ``ranks`` processes (real MPI even where the
    calling test set DEEPFUSION_NO_MPI through the ``cli`` fixture); trained here on first use."""
    key = hashlib.sha256(f"ranks={ranks}\n{config}".encode()).hexdigest()[:16]
    home = session_dir(tmp_path_factory) / "tiny_runs" / key
    home.mkdir(parents=True, exist_ok=True)
    run, done = home / "run", home / "done"
    with open(home / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker waits here, then reads the run
        if not done.exists():
            if run.exists():  # a caller before us failed: start again, never resume its run
                import shutil

                shutil.rmtree(run)
            cfg = home / "config.toml"
            cfg.write_text(config)
            p = deepfusion(ranks, ["train", str(cfg), "--set", f"run.dir={run}"], env=REAL_MPI)
            assert p.returncode == 0, p.stderr[-3000:]
            done.write_text(p.stdout)
    return str(run)
