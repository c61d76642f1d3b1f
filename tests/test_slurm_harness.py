"""The local Slurm harness without Slurm (runs in `make test`): when it skips and why, the
slurm.conf it writes, the job-state parsing, the bad-usage exit, the sweep's --sbatch guard."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from deepfusion.jobs import sweep as S
from deepfusion.jobs import slurm as SL
from tests.slurm_local import client as C
from tests.slurm_local import cluster as K
from tests.mpi_util import ROOT


def test_probe_skips_with_a_reason_when_not_root_and_no_cluster(monkeypatch):
    monkeypatch.setattr(K, "existing_cluster", lambda: None)
    monkeypatch.setattr(K.os, "geteuid", lambda: 1000)
    with pytest.raises(K.ClusterUnavailable, match="not root"):
        K.probe()


def test_probe_skips_as_root_without_slurm_or_apt_get(monkeypatch):
    monkeypatch.setattr(K, "existing_cluster", lambda: None)
    monkeypatch.setattr(K.os, "geteuid", lambda: 0)
    monkeypatch.setattr(K.shutil, "which", lambda name: None)
    with pytest.raises(K.ClusterUnavailable, match="no apt-get"):
        K.probe()
    monkeypatch.setattr(K.shutil, "which", lambda name: "/usr/bin/apt-get" if name == "apt-get" else None)
    assert K.probe() == "local"


def test_skip_exits_0_with_the_reason():
    """What `make test-slurm` prints as a non-root user: a skip, exit 0 (`make test` is unaffected)."""
    env = dict(os.environ, DEEPFUSION_SLURM_MODE="local")  # never use a live cluster from here
    res = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
                          "tests.slurm_local", "test"], capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)
    if "setpriv" in res.stderr:  # not root here, or no setpriv: the probe test above covers the logic
        pytest.skip(res.stderr.strip())
    assert res.returncode == 0 and "SKIPPED: not root" in res.stdout, res.stdout + res.stderr


def test_bad_usage_exits_2():
    res = subprocess.run([sys.executable, "-m", "tests.slurm_local", "start"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert res.returncode == 2 and "expected check, test" in res.stderr


def test_help_exits_0_with_the_usage():
    res = subprocess.run([sys.executable, "-m", "tests.slurm_local", "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert res.returncode == 0 and "python -m tests.slurm_local test [PYTEST_ARGS]" in res.stdout


def test_slurm_conf_has_what_the_tests_rely_on(tmp_path, monkeypatch):
    monkeypatch.setattr(K, "node_line", lambda: "NodeName=h1 CPUs=2 Boards=1 SocketsPerBoard=1 "
                                                "CoresPerSocket=2 ThreadsPerCore=1 RealMemory=1000")
    cl = K.LocalCluster(base=str(tmp_path))
    cl.write_config()
    conf = cl.conf.read_text()
    for line in ("JobRequeue=1", "ReturnToService=2", "ProctrackType=proctrack/linuxproc",
                 "SelectType=select/cons_tres", "MinJobAge=3600", "SlurmdUser=root",
                 f"AuthInfo=socket={cl.dir}/munge.socket,cred_expire=30", f"StateSaveLocation={cl.dir}/state",
                 "NodeName=h1 CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 "
                 "RealMemory=1000 NodeAddr=127.0.0.1", "PartitionName=debug Nodes=ALL Default=YES"):
        assert line in conf, line
    assert (cl.dir / "munge.key").stat().st_mode & 0o777 == 0o400
    assert cl.stop() == []  # nothing started, nothing to stop
    assert cl.info.env(tmp_path)[C.ENV_READY] == "1"


def test_job_info_parses_scontrol_one_line(monkeypatch):
    line = ("JobId=7 JobName=x UserId=root(0) JobState=PENDING Reason=BeginTime Dependency=(null) "
            "Requeue=1 Restarts=1 BatchFlag=1 ExitCode=0:0 StdOut=/w/slurm-7.out\n")
    monkeypatch.setattr(SL, "run_client", lambda argv, env=None: line)
    info = SL.job_info(7)
    assert (info["JobState"], info["Restarts"], info["ExitCode"], info["StdOut"]) == \
        ("PENDING", "1", "0:0", "/w/slurm-7.out")
    monkeypatch.setattr(SL, "run_client", lambda argv, env=None: "slurm_load_jobs error: Invalid job id\n")
    with pytest.raises(SL.SlurmError, match="does not know job 7"):
        SL.job_info(7)


def test_wait_job_times_out_with_the_state_not_a_hang(monkeypatch):
    monkeypatch.setattr(C, "job_info", lambda j, env=None: dict(JobState="PENDING", Reason="BeginTime",
                                                               Restarts="1"))
    with pytest.raises(C.SlurmError, match=r"did not finish within 0 s .*PENDING reason BeginTime"):
        C.wait_job(3, timeout=0.0)


def test_missing_client_is_a_clear_error():
    with pytest.raises(SL.SlurmError, match="not installed"):
        SL.run_client(["definitely-not-sbatch-xyz"])


def test_sweep_sbatch_needs_a_cluster(tmp_path, capsys):
    assert S.main(["--config", "c.toml", "--sbatch", "--out", str(tmp_path)]) == 2
    assert "--sbatch needs --cluster" in capsys.readouterr().err
