"""Talking to Slurm from ``deepfusion jobs sweep --sbatch`` (and the tests' local cluster):
submit a script, read a job's state from ``scontrol show job``, each call with a timeout.

Job states come from ``scontrol`` rather than sacct, which needs slurmdbd (a site may not run
it); Slurm forgets a finished job after MinJobAge, so a caller polls while its jobs run.
"""
from __future__ import annotations

import os
import re
import subprocess

CLIENT_TIMEOUT = 30      # seconds for one sbatch/scontrol/sinfo call
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


class SlurmError(RuntimeError):
    """A Slurm command failed or a job did not reach the expected state in time."""


def run_client(argv: list[str], env=None, timeout: float = CLIENT_TIMEOUT, cwd=None) -> str:
    """stdout of a Slurm client command; SlurmError (with stderr) on failure or timeout."""
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{' '.join(argv)}` did not answer in {timeout:.0f} s") from None
    except FileNotFoundError:
        raise SlurmError(f"`{argv[0]}` is not installed (no Slurm client on PATH)") from None
    if res.returncode != 0:
        raise SlurmError(f"`{' '.join(argv)}` failed (exit {res.returncode}): {res.stderr.strip()}")
    return res.stdout


def sbatch(script: str | os.PathLike, *options: str, cwd: str | os.PathLike | None = None, env=None) -> int:
    """Submit ``script`` (options go before it, overriding its #SBATCH lines) from ``cwd`` (the
    job's working directory); returns the job id."""
    out = run_client(["sbatch", "--parsable", *options, str(script)], env=env, cwd=cwd).strip()
    m = re.match(r"^(\d+)", out)
    if not m:
        raise SlurmError(f"sbatch printed no job id: {out!r}")
    return int(m.group(1))


def job_info(job_id: int, env=None) -> dict[str, str]:
    """``scontrol show job -o`` as a dict (JobState, ExitCode, Restarts, Reason, StdOut, ...)."""
    out = run_client(["scontrol", "show", "job", "-o", str(job_id)], env=env)
    info = dict(re.findall(r"(\S+?)=(\S*)", out))
    if "JobState" not in info:
        raise SlurmError(f"scontrol does not know job {job_id}: {out.strip()!r}")
    return info
