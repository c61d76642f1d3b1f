"""Lifecycle of a one-node Slurm cluster on localhost: probe, install, configure, start, stop.

Everything lives in one temporary directory (slurm.conf, munge key and socket, state, spool,
pid files, logs); clients find it through ``SLURM_CONF``, so a system Slurm or munge, if any, is
never touched. The daemons run in the foreground as children of this process (``-D``/``-F``),
so their PIDs are known without trusting pid files, and :meth:`LocalCluster.stop` ends exactly
those PIDs (plus the slurmstepd processes our slurmd forked, found by our SLURM_CONF in their
environment), whatever happened before.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from deepfusion.jobs.slurm import CLIENT_TIMEOUT, SlurmError, run_client
from tests.slurm_local.client import ClusterInfo

PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("munged", "slurmctld", "slurmd")
INSTALL_TIMEOUT = 1200   # seconds for one apt-get call (a slow mirror); a hang guard only
START_TIMEOUT = 120      # seconds for the node to come up idle
STOP_GRACE = 20          # seconds between SIGTERM and SIGKILL for each daemon
PARTITION = "debug"

SLURM_CONF = """\
# Written by tests/slurm_local/cluster.py: a one-node cluster on localhost, for tests only.
ClusterName=deepfusion-local
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
# One root-owned throw-away cluster: no slurm user, no system paths.
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued job waits before it may start again (default 120 s);
# 30 s keeps the requeue tests short and is still ample for a step launch on localhost.
AuthInfo=socket={dir}/munge.socket,cred_expire=30
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
# No cgroups (containers and VMs often have none writable): track processes by /proc, bind with
# sched_setaffinity so --cpu-bind and the ranks' affinity are real.
ProctrackType=proctrack/linuxproc
TaskPlugin={task_plugin}
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
# Requeue is what the job scripts rely on; a node that was down comes back by itself.
JobRequeue=1
ReturnToService=2
# Finished jobs stay visible to `scontrol show job` for an hour: there is no slurmdbd, so sacct
# has no data and the tests read job states from scontrol (and the jobcomp file).
MinJobAge=3600
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={dir}/jobcomp.log
SchedulerType=sched/backfill
SlurmctldTimeout=60
SlurmdTimeout=120
InactiveLimit=0
KillWait=10
{node} NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName={partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class ClusterUnavailable(RuntimeError):
    """This machine cannot run a local cluster (the message says why): the caller skips."""


# ------------------------------------------------------------------------------------ probing
def _ok(argv: list[str], timeout: float = CLIENT_TIMEOUT, env=None) -> bool:
    try:
        return subprocess.run(argv, capture_output=True, timeout=timeout, env=env).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def existing_cluster() -> ClusterInfo | None:
    """A running Slurm this machine is a client of (``scontrol ping`` answers), else None."""
    if not shutil.which("sbatch") or not _ok(["scontrol", "ping"]):
        return None
    part = os.environ.get("DEEPFUSION_SLURM_PARTITION", "")
    if not part:
        out = run_client(["sinfo", "-h", "-o", "%P"]).split()
        default = [p for p in out if p.endswith("*")]
        part = (default or out or [""])[0].rstrip("*")
    return ClusterInfo(partition=part, conf=os.environ.get("SLURM_CONF", ""), local=False)


def probe() -> str:
    """'existing' (a cluster answers), 'local' (we can install/start one), or raise ClusterUnavailable."""
    if os.environ.get("DEEPFUSION_SLURM_MODE", "") != "local" and existing_cluster() is not None:
        return "existing"
    if os.geteuid() != 0:
        raise ClusterUnavailable("not root and no running Slurm cluster answers `scontrol ping`: "
                                 "a local cluster needs root (slurmd runs jobs as their user)")
    if all(shutil.which(b) for b in (*DAEMONS, "sbatch", "munge")):
        return "local"
    if not shutil.which("apt-get"):
        raise ClusterUnavailable("root, but Slurm/munge are not installed and there is no apt-get "
                                 f"to install them (packages: {' '.join(PACKAGES)})")
    return "local"


def install_packages(log=print) -> None:
    """``apt-get install -y slurm-wlm munge``; on failure refresh the package lists and retry once."""
    if all(shutil.which(b) for b in (*DAEMONS, "sbatch", "munge")):
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "-q", "-o", "DPkg::Lock::Timeout=300", *PACKAGES]
    for attempt in (1, 2):
        log(f"[slurm-local] installing {' '.join(PACKAGES)} (apt-get, attempt {attempt})")
        try:
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise ClusterUnavailable(f"apt-get install did not finish in {INSTALL_TIMEOUT} s") from None
        if res.returncode == 0 and all(shutil.which(b) for b in (*DAEMONS, "sbatch")):
            return
        if attempt == 1:  # a fresh image often has no package lists yet
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=INSTALL_TIMEOUT)
    raise ClusterUnavailable(f"apt-get install {' '.join(PACKAGES)} failed:\n{res.stdout[-1500:]}{res.stderr[-1500:]}")


# ------------------------------------------------------------------------------------ the cluster
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_line() -> str:
    """``NodeName=HOST CPUs=.. Boards=.. SocketsPerBoard=.. CoresPerSocket=.. ThreadsPerCore=..
    RealMemory=..`` as this machine's slurmd measures it (so the node is never drained for a
    mismatch)."""
    res = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=CLIENT_TIMEOUT)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("NodeName=")), None)
    if res.returncode != 0 or line is None:
        raise SlurmError(f"`slurmd -C` did not describe this node:\n{res.stdout}{res.stderr}")
    return line.strip()


class LocalCluster:
    """munged + slurmctld + slurmd in a temporary directory. Use as a context manager."""

    def __init__(self, base: str | None = None, task_plugin: str = "task/affinity", log=print):
        self.dir = Path(tempfile.mkdtemp(prefix="deepfusion-slurm-", dir=base))
        self.conf = self.dir / "slurm.conf"
        self.task_plugin = task_plugin
        self.procs: dict[str, subprocess.Popen] = {}
        self.log = log
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.env.pop("SLURM_JOB_ID", None)  # never look like we are inside someone's job

    @property
    def info(self) -> ClusterInfo:
        return ClusterInfo(partition=PARTITION, conf=str(self.conf), local=True)

    def write_config(self) -> None:
        for sub in ("state", "spool", "work"):
            (self.dir / sub).mkdir(mode=0o755, exist_ok=True)
        os.chmod(self.dir, 0o755)  # job steps (root here, but any user elsewhere) read their work dir
        node = node_line()
        self.host = node.split()[0].split("=", 1)[1]
        text = SLURM_CONF.format(host=self.host, ctld_port=_free_port(), slurmd_port=_free_port(),
                                 dir=self.dir, task_plugin=self.task_plugin, node=node,
                                 partition=PARTITION)
        self.conf.write_text(text)
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = open(self.dir / f"{name}.out", "wb")
        # own session: a Ctrl-C at the terminal reaches us, and we stop the daemons in order
        self.procs[name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True, cwd=self.dir)
        out.close()
        self.log(f"[slurm-local] started {name} (pid {self.procs[name].pid})")

    def _wait(self, what: str, ready, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise SlurmError(f"{', '.join(dead)} exited while waiting for {what}:\n{self.log_tails()}")
            if ready():
                return
            time.sleep(0.5)
        raise SlurmError(f"timed out after {timeout:.0f} s waiting for {what}:\n{self.log_tails()}")

    def start(self) -> None:
        d = self.dir
        self._spawn("munged", ["munged", "-F", "--force", f"--socket={d}/munge.socket",
                               f"--key-file={d}/munge.key", f"--pid-file={d}/munged.pid",
                               f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed"])
        self._wait("munged to answer", lambda: _ok(
            ["bash", "-c", f"munge -n -S {d}/munge.socket | unmunge -S {d}/munge.socket"]))
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._wait("slurmctld to answer `scontrol ping`", lambda: _ok(["scontrol", "ping"], env=self.env))
        self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf)])
        self._wait(f"node {self.host} to be idle", self._node_idle)
        self.log(f"[slurm-local] node {self.host} idle; SLURM_CONF={self.conf}")

    def _node_idle(self) -> bool:
        try:
            out = run_client(["sinfo", "-h", "-N", "-o", "%T"], env=self.env)
        except SlurmError:
            return False
        return out.strip() == "idle"

    # ------------------------------------------------------------------------------ stop
    def _cancel_jobs(self) -> None:
        """Cancel whatever is still queued/running on our cluster and give it KillWait to end."""
        try:
            ids = run_client(["squeue", "-h", "-o", "%i"], env=self.env).split()
        except SlurmError:
            return
        if not ids:
            return
        subprocess.run(["scancel", *ids], env=self.env, capture_output=True, timeout=CLIENT_TIMEOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if not run_client(["squeue", "-h", "-o", "%i"], env=self.env).split():
                    return
            except SlurmError:
                return
            time.sleep(1)

    def _our_stepds(self) -> list[int]:
        """slurmstepd processes of our slurmd: they carry our SLURM_CONF in their environment."""
        marker = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
                if b"slurmstepd" in argv0 and marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    pids.append(int(pid))
            except OSError:
                continue
        return pids

    def stop(self) -> list[str]:
        """Stop every daemon we started (slurmd, slurmctld, munged: by PID); returns problems."""
        problems = []
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            self._cancel_jobs()
        for name in reversed(DAEMONS):
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(STOP_GRACE)
            except subprocess.TimeoutExpired:
                problems.append(f"{name} (pid {p.pid}) ignored SIGTERM for {STOP_GRACE} s: killed")
                p.kill()
                p.wait(STOP_GRACE)
            self.log(f"[slurm-local] stopped {name} (pid {p.pid})")
        for pid in self._our_stepds():
            problems.append(f"slurmstepd pid {pid} outlived slurmd: killed")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return problems

    def log_tails(self, lines: int = 15) -> str:
        out = []
        for name in ("munged.log", "slurmctld.log", "slurmd.log", *(f"{d}.out" for d in DAEMONS)):
            f = self.dir / name
            if f.exists() and f.stat().st_size:
                tail = f.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {f}\n" + "\n".join(tail))
        return "\n".join(out) or "(no daemon logs)"

    def __enter__(self) -> "LocalCluster":
        try:
            self.write_config()
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for msg in self.stop():
            self.log(f"[slurm-local] warning: {msg}")
