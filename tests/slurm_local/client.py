"""Talking to a running Slurm from tests and tools: sbatch, job states, waiting with a timeout.

Job states come from ``scontrol show job`` (the local cluster keeps finished jobs for an hour,
MinJobAge=3600) because sacct needs slurmdbd, which the local cluster does not run. Every call
has a timeout; a wait that runs out fails with the job's last state and the tail of its output,
never hangs.
"""
from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

CLIENT_TIMEOUT = 30      # seconds for one sbatch/scontrol/sinfo call
JOB_TIMEOUT = 600        # seconds a test waits for a job by default (tiny jobs: a hang guard only)
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
# the environment variables `tests.slurm_local run` sets for the tests it starts
ENV_READY = "DEEPFUSION_SLURM"             # "1": a cluster is up for the slurm tests
ENV_PARTITION = "DEEPFUSION_SLURM_PARTITION"
ENV_WORKDIR = "DEEPFUSION_SLURM_WORKDIR"   # where jobs write (must be visible to the nodes)
ENV_LOCAL = "DEEPFUSION_SLURM_LOCAL"       # "1": our throw-away one-node cluster


class SlurmError(RuntimeError):
    """A Slurm command failed or a job did not reach the expected state in time."""


@dataclass
class ClusterInfo:
    partition: str
    conf: str
    local: bool

    def env(self, workdir: str | os.PathLike) -> dict:
        """Variables that tell the slurm tests a cluster is up (and the clients where it is)."""
        out = {ENV_READY: "1", ENV_PARTITION: self.partition, ENV_WORKDIR: str(workdir),
               ENV_LOCAL: "1" if self.local else "0"}
        if self.conf:
            out["SLURM_CONF"] = self.conf
        return out


def cluster_up() -> bool:
    return os.environ.get(ENV_READY) == "1"


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


def tail(path: str | os.PathLike | None, n: int = 40) -> str:
    if not path or not Path(path).exists():
        return f"(no output file {path})"
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])


def wait_job(job_id: int, until=None, timeout: float = JOB_TIMEOUT, env=None, what: str = "") -> dict:
    """Poll until ``until(info)`` is true (default: a final state); returns the job info.

    On timeout raise SlurmError naming the last state, the reason and the output's tail."""
    until = until or (lambda i: i["JobState"] in FINAL_STATES)
    deadline = time.monotonic() + timeout
    while True:  # polls at least once, so the message below always has a state
        info = job_info(job_id, env)
        if until(info):
            return info
        if time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    raise SlurmError(f"job {job_id} did not {what or 'finish'} within {timeout:.0f} s (hang guard): "
                     f"state {info.get('JobState')} reason {info.get('Reason')} restarts "
                     f"{info.get('Restarts')}\n{tail(info.get('StdOut'))}")


def wait_for_file(path: Path, ready, timeout: float, job_id: int, env=None, what: str = "") -> None:
    """Poll until ``ready(path)``; fail early if the job already ended, or after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready(path):
            return
        info = job_info(job_id, env)
        if info["JobState"] in FINAL_STATES:
            raise SlurmError(f"job {job_id} ended ({info['JobState']}) before {what}:\n{tail(info.get('StdOut'))}")
        time.sleep(0.5)
    raise SlurmError(f"{what} did not happen within {timeout:.0f} s (job {job_id})")
