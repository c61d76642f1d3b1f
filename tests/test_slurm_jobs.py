"""Rendered job scripts under a real Slurm: completion, requeue on signal, time limit, failure.

`make test-slurm` (python -m tests.slurm_local test) starts a one-node cluster on localhost and
sets DEEPFUSION_SLURM=1; without it every test here is skipped. Each test renders a script with
`deepfusion jobs render`, submits it with sbatch, and reads the job's state from
`scontrol show job` (no slurmdbd: sacct has no data), its output file and the run's
metrics.jsonl. Every wait has a timeout that is a hang guard, never an assertion about speed.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from deepfusion.jobs.slurm import FINAL_STATES, run_client, sbatch
from tests.slurm_local.client import (ENV_LOCAL, ENV_PARTITION, ENV_WORKDIR, cluster_up, wait_for_file,
                                     wait_job)
from tests.tiny_configs import TINY, variant

pytestmark = [pytest.mark.slurm,
              pytest.mark.skipif(not cluster_up(), reason="needs a Slurm cluster: `make test-slurm` starts one")]

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
STEPS = 600          # the tiny run: long enough that a signal sent after step 20 lands mid-run
SIGNAL_AFTER = 20    # logged steps before the test sends USR1
HANG_GUARD = 900     # seconds for any one wait on a job

CONFIG = variant(TINY, "run.plots=true", "train.epochs=100000", f"train.max_steps={STEPS}",
                 "train.log_every=10", "train.checksum_every=50")


@pytest.fixture(scope="module")
def slurm():
    """Where and how to submit: partition, environment (the venv's bin first on PATH, as after
    `source .venv/bin/activate`), a work dir the nodes can see, a profile file and the config."""
    work = Path(os.environ[ENV_WORKDIR]) / f"jobs-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    part = os.environ.get(ENV_PARTITION, "")
    env = dict(os.environ, PATH=f"{VENV_BIN}:{os.environ['PATH']}", PYTHONUNBUFFERED="1")
    cpus = run_client(["sinfo", "-h", "-N", "-o", "%c", *(["-p", part] if part else [])], env=env).split()
    # the generic srun profile, pointed at this cluster; --mpi=pmi2 is what the pip mpich needs
    profiles = work / "profiles.toml"
    profiles.write_text(f'[generic-slurm]\npartition = "{part}"\naccount = ""\ncores_per_node = {cpus[0]}\n'
                        'sockets = 1\nnuma_domains = 1\nmemory_gb = 1\nranks_per_node = 2\n'
                        f'threads_per_rank = 1\nsrun_mpi = "{os.environ.get("DEEPFUSION_SLURM_SRUN_MPI", "pmi2")}"\n')
    config = work / "tiny.toml"
    config.write_text(CONFIG)
    return SimpleNamespace(work=work, part=part, env=env, profiles=profiles, config=config,
                           local=os.environ.get(ENV_LOCAL) == "1")


def render(s, name: str, cluster: str = "generic-slurm", time: str = "00:10:00", sets=(), extra=(),
           rc: int = 0) -> tuple[Path, Path]:
    """`deepfusion jobs render` into WORK/name/job.sh, run dir WORK/name/run-$SLURM_JOB_ID; the
    render exits ``rc`` (its stderr is then at WORK/name/render.err)."""
    d = s.work / name
    d.mkdir(exist_ok=True)
    script = d / "job.sh"
    argv = [sys.executable, "-m", "deepfusion", "jobs", "render", "--cluster", cluster, "--profiles",
            str(s.profiles), "--nodes", "1", "--ranks-per-node", "2", "--threads-per-rank", "1", "--time", time,
            "--config", str(s.config), "--run-dir", f"{d}/run-${{SLURM_JOB_ID}}", "--job-name", name,
            "--out", str(script), *[a for kv in sets for a in ("--set", kv)], *extra]
    res = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=s.env, timeout=120)
    assert res.returncode == rc, res.stderr
    (d / "render.err").write_text(res.stderr)
    return d, script


def submit(s, d: Path, script: Path, *options: str) -> int:
    return sbatch(script, *(["-p", s.part] if s.part else []), "-o", f"{d}/slurm-%j.out", *options,
                  cwd=d, env=s.env)


def steps(metrics: Path) -> dict[int, float]:
    """{step: loss} from a metrics.jsonl (the last record wins if a step was logged twice)."""
    if not metrics.exists():
        return {}
    out = {}
    for line in metrics.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written right now
        if rec.get("kind") == "step":
            out[rec["step"]] = rec["loss"]
    return out


def output(info: dict) -> str:
    return Path(info["StdOut"]).read_text(errors="replace")


def checkpoint_step(out: str) -> int:
    m = re.search(r"checkpoint written at step (\d+)", out)
    assert m, f"no checkpoint line in the job output:\n{out[-3000:]}"
    return int(m.group(1))


@pytest.fixture(scope="module")
def reference(slurm):
    """The generic srun script of the tiny config, uninterrupted: test 1 checks it, test 2 compares."""
    d, script = render(slurm, "reference")
    jid = submit(slurm, d, script)
    info = wait_job(jid, timeout=HANG_GUARD, env=slurm.env)
    return SimpleNamespace(script=script, info=info, out=output(info), run=d / f"run-{jid}")


def test_rendered_srun_script_runs_to_completion_with_its_layout(slurm, reference):
    """sbatch of the generic-slurm script: COMPLETED, exit 0, all STEPS taken, and the output shows
    the layout the script asked for as the trainer saw it: one MPI world of 2 ranks (so srun's PMI
    reached MPICH; --mpi=none would give two 1-rank worlds) with 1 thread each."""
    text, info, out = reference.script.read_text(), reference.info, reference.out
    assert "#SBATCH --ntasks-per-node=2" in text and "#SBATCH --cpus-per-task=1" in text
    assert re.search(r"^srun .*--cpus-per-task=1 --cpu-bind=cores .*--mpi=pmi2 ", text, re.M), text
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), out[-3000:]
    assert "[deepfusion-job] 1 node(s) x 2 rank(s)/node x 1 thread(s)/rank on generic-slurm" in out
    # the environment the renderer ran from, activated before `set -u`; absolute CONFIG
    assert text.index(f"source {VENV_BIN}/activate\n") < text.index("\nset -uo pipefail\n")
    assert f'CONFIG="{slurm.config}"' in text
    assert "layout: 2 rank(s) on 1 host(s), threads per rank [1]" in out, out[-3000:]
    ranks = re.findall(r"rank\s+(\d+) local_rank\s+\d+ host \S+ threads (\d+) affinity (\S+)", out)
    assert sorted(r for r, _, _ in ranks) == ["0", "1"] and {t for _, t, _ in ranks} == {"1"}, ranks
    if slurm.local:  # task/affinity + --cpu-bind=cores: each rank on its own core
        assert ranks[0][2] != ranks[1][2], ranks
    assert max(steps(reference.run / "metrics.jsonl")) == STEPS
    assert "job step exited with code 0" in out and "requeue" not in out


def test_usr1_checkpoints_requeues_and_resumes_to_the_same_final_loss(slurm, reference):
    """`scancel --batch --signal=USR1` mid-run (what --signal=B:USR1@120 does before the time
    limit): the step checkpoints and exits 99, the script runs `scontrol requeue`, Slurm starts the
    job again (same id, Restarts=1), it resumes from that checkpoint and ends at the same final step
    with exactly the same final loss, and the same loss at every logged step after the checkpoint,
    as the uninterrupted run (float64, 1 thread per rank, deterministic data)."""
    d, script = render(slurm, "requeue")
    jid = submit(slurm, d, script)
    metrics = d / f"run-{jid}" / "metrics.jsonl"
    wait_for_file(metrics, lambda p: max(steps(p), default=0) >= SIGNAL_AFTER, HANG_GUARD, jid,
                  env=slurm.env, what=f"training to reach step {SIGNAL_AFTER}")
    run_client(["scancel", "--batch", "--signal=USR1", str(jid)], env=slurm.env)
    info = wait_job(jid, timeout=HANG_GUARD, env=slurm.env, what="finish after its requeue")
    out = output(info)
    assert info["Restarts"] != "0", f"never requeued: the run finished before the signal?\n{out[-3000:]}"
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), out[-3000:]
    k = checkpoint_step(out)
    assert SIGNAL_AFTER <= k < STEPS
    for line in ("got SIGUSR1", "job step exited with code 99", f"checkpoint written: scontrol requeue {jid}",
                 f"resumed from {d}/run-{jid}/checkpoints/step_{k:08d}.h5 at step {k}",
                 "job step exited with code 0"):
        assert line in out, (line, out[-3000:])
    mine, ref = steps(metrics), steps(reference.run / "metrics.jsonl")
    assert max(mine) == max(ref) == STEPS
    assert mine[STEPS] == ref[STEPS], (mine[STEPS], ref[STEPS])
    after = [i for i in ref if i > k]
    assert after and [mine[i] for i in after] == [ref[i] for i in after]


def test_time_limit_signal_requeues_then_scancel_is_final(slurm):
    """The real time-limit path with the `local` profile (mpiexec inside the allocation): with
    `-t 00:03:00` and the script's own `--signal=B:USR1@120`, Slurm (not the test) sends USR1; the
    job checkpoints, requeues itself and the requeued job trains on from that checkpoint. Then a
    plain `scancel` (TERM) checkpoints again and the job stays CANCELLED: it is not requeued."""
    d, script = render(slurm, "timelimit", cluster="local", time="00:03:00", sets=("train.max_steps=10000000",))
    text = script.read_text()
    assert "#SBATCH -t 00:03:00" in text and "#SBATCH --signal=B:USR1@120" in text and "\nmpiexec -n 2 " in text
    jid = submit(slurm, d, script)
    info = wait_job(jid, until=lambda i: i["Restarts"] != "0" or i["JobState"] in FINAL_STATES,
                    timeout=HANG_GUARD, env=slurm.env, what="get its time-limit signal and requeue")
    out = output(info)
    assert info["Restarts"] == "1", f"{info['JobState']}: not requeued\n{out[-3000:]}"
    assert "got SIGUSR1" in out and f"checkpoint written: scontrol requeue {jid}" in out, out[-3000:]
    k = checkpoint_step(out)
    metrics = d / f"run-{jid}" / "metrics.jsonl"
    wait_for_file(metrics, lambda p: max(steps(p), default=0) > k, HANG_GUARD, jid, env=slurm.env,
                  what=f"the requeued job to train past its checkpoint (step {k})")
    run_client(["scancel", str(jid)], env=slurm.env)
    info = wait_job(jid, timeout=HANG_GUARD, env=slurm.env, what="end after scancel")
    out = output(info)
    assert f"resumed from {d}/run-{jid}/checkpoints/step_{k:08d}.h5 at step {k}" in out, out[-3000:]
    assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "1"), out[-3000:]
    assert "got SIGTERM" in out and "not requeued" in out, out[-3000:]


def test_bad_config_fails_clearly_and_is_not_requeued(slurm):
    """A typo in the config: `jobs render` refuses it with train's message (exit 2, no script);
    rendered anyway (--no-check: a config that changed after rendering), the job ends FAILED
    with exit code 2 (deepfusion's bad-input code), the output says what is wrong, and nothing
    requeues it."""
    d, script = render(slurm, "badconfig", sets=("train.epochz=3",), rc=2)
    err = (d / "render.err").read_text()
    assert "would refuse this job: (rank 0) unknown key 'train.epochz'" in err and not script.exists(), err
    d, script = render(slurm, "badconfig", sets=("train.epochz=3",), extra=("--no-check",))
    jid = submit(slurm, d, script)
    info = wait_job(jid, timeout=HANG_GUARD, env=slurm.env)
    out = output(info)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "2:0", "0"), out[-3000:]
    assert "unknown key 'train.epochz'; did you mean 'train.epochs'?" in out, out[-3000:]
    assert "job step exited with code 2" in out and "requeue" not in out
    if slurm.local:  # the jobcomp record (what sacct would show with slurmdbd)
        comp = Path(os.environ["SLURM_CONF"]).with_name("jobcomp.log").read_text()
        assert re.search(rf"^JobId={jid} .*JobState=FAILED .*ExitCode=2:0", comp, re.M), comp[-2000:]


def test_srun_mpi_types_with_the_pip_mpich(slurm):
    """The measured launcher rule: `srun --mpi=pmi2` gives the pip mpich one world of 2 ranks;
    `--mpi=none` starts 2 separate 1-rank worlds (each would train alone), so srun profiles for this
    MPI must set srun_mpi = "pmi2". (PMIx: see docs/clusters.md; not asserted here.)"""
    code = "from mpi4py import MPI; c = MPI.COMM_WORLD; print('world', c.rank, c.size, flush=True)"
    sizes = {}
    for mpi in ("pmi2", "none"):
        argv = ["srun", *(["-p", slurm.part] if slurm.part else []), "-N1", "-n2", "-t", "5", f"--mpi={mpi}",
                sys.executable, "-c", code]
        res = subprocess.run(argv, capture_output=True, text=True, env=slurm.env, timeout=HANG_GUARD)
        assert res.returncode == 0, (shlex.join(argv), res.stderr)
        sizes[mpi] = sorted(re.findall(r"world (\d+) (\d+)", res.stdout))
    assert sizes["pmi2"] == [("0", "2"), ("1", "2")], sizes
    assert sizes["none"] == [("0", "1"), ("0", "1")], sizes


def test_srun_without_pmi_is_refused_instead_of_training_alone(slurm):
    """`srun --mpi=none deepfusion train` would start two 1-rank worlds training into one run
    directory; each copy sees SLURM_STEP_NUM_TASKS=2 against a world of 1 and stops with exit 2,
    naming the fix. Nothing is trained."""
    run = slurm.work / "mpi-none-run"
    argv = ["srun", *(["-p", slurm.part] if slurm.part else []), "-N1", "-n2", "-t", "5", "--mpi=none",
            sys.executable, "-m", "deepfusion", "train", str(slurm.config), "--set", f"run.dir={run}"]
    res = subprocess.run(argv, capture_output=True, text=True, env=slurm.env, timeout=HANG_GUARD)
    assert res.returncode != 0, res.stdout
    assert res.stderr.count("srun started 2 processes (SLURM_STEP_NUM_TASKS=2)") == 2, res.stderr
    assert "srun --mpi=pmi2" in res.stderr and not run.exists()
