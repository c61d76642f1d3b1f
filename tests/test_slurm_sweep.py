"""`deepfusion jobs sweep` under a real Slurm: each layout as its own sbatch job, or the whole sweep
inside one allocation (the batch script shown in docs/clusters.md). Skipped unless
`make test-slurm` started a cluster (DEEPFUSION_SLURM=1). Timeouts are hang guards only."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from deepfusion.jobs.slurm import sbatch
from tests.slurm_local.client import cluster_up, wait_job
from tests.test_slurm_jobs import HANG_GUARD, ROOT, slurm  # noqa: F401 (slurm: a fixture)

pytestmark = [pytest.mark.slurm,
              pytest.mark.skipif(not cluster_up(), reason="needs a Slurm cluster: `make test-slurm` starts one")]

LAYOUTS = {(1, 1), (2, 1), (1, 2)}
SWEEP_ARGS = ["--layouts", "1x1,2x1,1x2", "--mode", "strong", "--steps", "6", "--warmup", "1",
              "--global-batch", "4", "--timeout", str(HANG_GUARD)]


def check_sweep(out: Path) -> list[dict]:
    """Every layout ran (status ok), measured its 5 post-warm-up steps, and its log shows the world
    the trainer saw: R ranks x T threads."""
    doc = json.loads((out / "sweep.json").read_text())
    rows = {(r["ranks"], r["threads"]): r for r in doc["layouts"]}
    logs = {p.parent.name: p.read_text(errors="replace")[-2000:] for p in out.glob("runs/*/stdout.log")}
    assert set(rows) == LAYOUTS, (rows, logs)
    for (r, t), row in rows.items():
        assert row["status"] == "ok" and row["steps_measured"] == 5, (row, logs)
        assert row["median_time_step"] > 0
        log = (out / "runs" / f"1n{r}x{t}" / "stdout.log").read_text(errors="replace")
        assert f"layout: {r} rank(s) on 1 host(s), threads per rank [{t}]" in log, log[-2000:]
    assert (out / "sweep.csv").exists() and (out / "sweep.png").exists()
    return doc["meta"]["commands"]


def test_sweep_submits_each_layout_through_sbatch(slurm):  # noqa: F811
    """`jobs sweep --sbatch`: one rendered job script per layout, submitted, waited for, aggregated."""
    out = slurm.work / "sweep-sbatch"
    argv = [sys.executable, "-m", "deepfusion", "jobs", "sweep", "--cluster", "generic-slurm", "--profiles",
            str(slurm.profiles), "--nodes", "1", "--config", str(slurm.config), "--out", str(out), "--sbatch",
            "--time", "00:10:00", *SWEEP_ARGS]
    if slurm.part:
        argv += ["--sbatch-args", f"-p {slurm.part}"]
    res = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=slurm.env, timeout=3 * HANG_GUARD)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert len(re.findall(r"submitted job \d+", res.stdout)) == 3, res.stdout
    commands = check_sweep(out)
    assert all(c.startswith("sbatch ") and "job.sh (job " in c for c in commands), commands
    for r, t in LAYOUTS:
        script = (out / "runs" / f"1n{r}x{t}" / "job.sh").read_text()
        assert f"#SBATCH --ntasks-per-node={r}\n" in script and f"export OMP_NUM_THREADS={t}\n" in script


def test_sweep_runs_inside_one_allocation(slurm):  # noqa: F811
    """The README's one-allocation form: a batch script asks for a whole node and runs
    `deepfusion jobs sweep --cluster ...`, which starts each layout as an srun step inside it."""
    out = slurm.work / "sweep-alloc"
    out.mkdir()
    script = out / "sweep.sh"
    script.write_text(
        "#!/usr/bin/env bash\n"
        "#SBATCH -N 1 --ntasks-per-node=2 --cpus-per-task=1 -t 00:20:00\n"
        "set -euo pipefail\n"
        f"deepfusion jobs sweep --cluster generic-slurm --profiles {slurm.profiles} --nodes 1 "
        f"--config {slurm.config} --out {out} {' '.join(SWEEP_ARGS)}\n")
    jid = sbatch(script, *(["-p", slurm.part] if slurm.part else []), "-o", f"{out}/slurm-%j.out",
                 cwd=out, env=slurm.env)
    info = wait_job(jid, timeout=3 * HANG_GUARD, env=slurm.env)
    text = Path(info["StdOut"]).read_text(errors="replace")
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text[-3000:]
    commands = check_sweep(out)
    assert all(c.startswith("srun ") and "--mpi=pmi2" in c for c in commands), commands
