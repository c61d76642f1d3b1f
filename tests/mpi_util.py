"""Run real MPI jobs from pytest: ``mpiexec -n P python ...`` with the venv's launcher.

The timeout is a hang guard for the suite, never an assertion about speed.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HANG_GUARD = 240  # seconds; oversubscribed ranks busy-poll, so generous
# env= of a launch from a test that uses the in-process ``cli`` fixture (which sets
# DEEPFUSION_NO_MPI=1 in this process, and a launch inherits the environment): real MPI again
REAL_MPI = {"DEEPFUSION_NO_MPI": "0"}


def mpiexec() -> str:
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return local if os.path.exists(local) else (shutil.which("mpiexec") or "mpiexec")


def run_mpi(n: int, argv: list[str], *, timeout: float = HANG_GUARD, env=None) -> subprocess.CompletedProcess:
    """Run ``python argv...`` on n ranks, one thread each; returns the completed process."""
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    e.update(env or {})
    cmd = [mpiexec(), "-n", str(n), sys.executable] + argv
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e, cwd=ROOT)


def deepfusion(n: int, args: list[str], **kw) -> subprocess.CompletedProcess:
    """``deepfusion ARGS`` on n ranks (n=0: a plain process, no launcher at all)."""
    if n == 0:
        e = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
        return subprocess.run([sys.executable, "-m", "deepfusion"] + args, capture_output=True,
                              text=True, timeout=kw.get("timeout", HANG_GUARD), env=e, cwd=ROOT)
    return run_mpi(n, ["-m", "deepfusion"] + args, **kw)


def commands(n: int, argvs: list[list[str]], **kw) -> list[tuple[int, str, str]]:
    """``deepfusion ARGV`` for each of ``argvs`` in turn, in one launch on n ranks
    (``tests/mpi_scripts/commands.py``); asserts the launch exited 0 and returns each command's
    (exit code, stdout, stderr)."""
    p = run_mpi(n, ["tests/mpi_scripts/commands.py"] + [json.dumps(a) for a in argvs], **kw)
    assert p.returncode == 0, p.stderr[-3000:]
    outs = re.split(r"^=== command \d+\n", p.stdout, flags=re.M)[1:]
    errs = re.split(r"^=== command \d+\n", p.stderr, flags=re.M)[1:]
    assert len(outs) == len(errs) == len(argvs), p.stdout[-3000:] + p.stderr[-3000:]
    done = []
    for i, (out, err) in enumerate(zip(outs, errs)):
        end = re.search(rf"^=== exit {i} (-?\d+)$", out, flags=re.M)
        done.append((int(end.group(1)), out[:end.start()], err))
    return done


def run_script_cases(n: int, script: str, cases: list[str]) -> None:
    """Run a case-running check script (``tests/mpi_scripts/cases.py``) on n ranks; assert it
    exits 0 and reports 'OK P=n case=CASE' for every case."""
    p = run_mpi(n, [script] + cases)
    assert p.returncode == 0, p.stderr + p.stdout
    for case in cases:
        assert f"OK P={n} case={case} " in p.stdout, p.stdout
