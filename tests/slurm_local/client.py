"""Waiting for a running Slurm's jobs from tests, with a timeout: a wait that runs out fails
with the job's last state and the tail of its output, never hangs. Submitting and reading a
job's state is the product's (:mod:`deepfusion.jobs.slurm`, which ``jobs sweep --sbatch`` uses);
the local cluster keeps finished jobs for an hour (MinJobAge=3600), so ``scontrol`` still knows
them when a test looks.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from deepfusion.jobs.slurm import FINAL_STATES, SlurmError, job_info

JOB_TIMEOUT = 600        # seconds a test waits for a job by default (tiny jobs: a hang guard only)
# the environment variables `tests.slurm_local run` sets for the tests it starts
ENV_READY = "DEEPFUSION_SLURM"             # "1": a cluster is up for the slurm tests
ENV_PARTITION = "DEEPFUSION_SLURM_PARTITION"
ENV_WORKDIR = "DEEPFUSION_SLURM_WORKDIR"   # where jobs write (must be visible to the nodes)
ENV_LOCAL = "DEEPFUSION_SLURM_LOCAL"       # "1": our throw-away one-node cluster


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
