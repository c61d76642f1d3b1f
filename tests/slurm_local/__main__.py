"""Command line of the local Slurm harness (``make test-slurm`` runs ``test``).

    python -m tests.slurm_local check               can this machine run the Slurm tests? (why not)
    python -m tests.slurm_local test [PYTEST_ARGS]  start a cluster (or use a running one), run the
                                                   slurm-marked tests, stop what it started
    python -m tests.slurm_local exec CMD [ARGS]     the same cluster around any command (SLURM_CONF
                                                   and the DEEPFUSION_SLURM_* variables set)
    --keep   keep the temporary directory (logs, job outputs) even when everything passed
    --help   this text

Exit codes: 0 passed (or skipped: the machine cannot run Slurm, the reason is printed), 1 a test
or the cluster failed (daemon logs are printed, the directory is kept), 2 bad usage.
"""
from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from deepfusion.jobs.slurm import SlurmError
from tests.slurm_local.cluster import ClusterUnavailable, LocalCluster, existing_cluster, install_packages, probe

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT = 2400  # seconds for the whole test run: a hang guard (the tests take a few minutes)


def _log(msg: str) -> None:
    print(msg, flush=True)


def _tests() -> list[str]:
    return sorted(glob.glob(str(ROOT / "tests" / "test_slurm*.py")))


def _run(cmd: list[str], env: dict) -> int:
    _log(f"[slurm-local] running: {' '.join(cmd)}")
    try:
        return subprocess.run(cmd, env=env, cwd=ROOT, timeout=RUN_TIMEOUT).returncode
    except subprocess.TimeoutExpired:
        _log(f"[slurm-local] FAILED: the command did not finish in {RUN_TIMEOUT} s (hang guard)")
        return 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    keep = "--keep" in argv
    argv = [a for a in argv if a != "--keep"]
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if not argv or argv[0] not in ("check", "test", "exec") or (argv[0] == "exec" and len(argv) < 2):
        print(f"error: expected check, test [PYTEST_ARGS] or exec CMD, got {' '.join(argv) or 'nothing'}\n\n"
              f"{__doc__}", file=sys.stderr)
        return 2
    what, rest = argv[0], argv[1:]
    try:
        mode = probe()
    except ClusterUnavailable as exc:
        _log(f"[slurm-local] SKIPPED: {exc}. `make test` does not need Slurm.")
        return 0
    if what == "check":
        how = ("a running Slurm cluster answers" if mode == "existing" else
               "root: installs Slurm/munge if missing and starts a one-node cluster on localhost")
        _log(f"[slurm-local] can run: {how}")
        return 0
    cmd = rest if what == "exec" else [sys.executable, "-m", "pytest", "-q", "-m", "slurm", *_tests(), *rest]
    # SIGTERM (a CI timeout, kill) must still run the finally blocks that stop the daemons
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.monotonic()
    if mode == "existing":
        info = existing_cluster()
        work = Path(os.environ.get("DEEPFUSION_SLURM_WORKDIR") or ROOT / "runs" / f"slurm-tests-{os.getpid()}")
        work.mkdir(parents=True, exist_ok=True)
        _log(f"[slurm-local] using the running cluster (partition {info.partition!r}); jobs write in {work}")
        rc = _run(cmd, dict(os.environ, **info.env(work)))
        _log(f"[slurm-local] {'passed' if rc == 0 else 'FAILED'} in {time.monotonic() - t0:.0f} s")
        return 0 if rc == 0 else 1
    try:
        install_packages(_log)
    except ClusterUnavailable as exc:
        _log(f"[slurm-local] FAILED: {exc}")
        return 1
    cluster = LocalCluster(log=_log)
    rc = 1
    try:
        with cluster:
            rc = _run(cmd, dict(cluster.env, **cluster.info.env(cluster.dir / "work")))
            if rc != 0:
                _log(f"[slurm-local] daemon logs:\n{cluster.log_tails()}")
    except SlurmError as exc:
        _log(f"[slurm-local] FAILED to start the cluster: {exc}")
    finally:
        if rc == 0 and not keep:
            shutil.rmtree(cluster.dir, ignore_errors=True)
        else:
            _log(f"[slurm-local] kept {cluster.dir} (slurm.conf, daemon logs, job outputs in work/)")
    _log(f"[slurm-local] {'passed' if rc == 0 else 'FAILED'} in {time.monotonic() - t0:.0f} s; "
         "every daemon started here is stopped")
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
