"""deepfusion/jobs/: rendered job scripts (every launcher/profile) and the sweep aggregation."""
from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from deepfusion.jobs import render as R
from deepfusion.jobs import sweep as S
from tests.mpi_util import mpiexec as find_mpiexec

ROOT = Path(__file__).resolve().parents[1]
BASH = shutil.which("bash")
PROFILES = R.load_profiles()

BINDING = {  # launcher -> strings that must be in the script
    "srun": ["--cpu-bind=cores", "--cpus-per-task=", "SRUN_CPUS_PER_TASK="],
    "mpirun": ["--map-by ppr:", ":PE=", "--bind-to core", "-x OMP_NUM_THREADS"],
    "ibrun": ["I_MPI_PIN_DOMAIN=omp", "ibrun "],
}


def _layout(prof):
    return prof["ranks_per_node"], prof["threads_per_rank"]


@pytest.mark.parametrize("cluster", sorted(PROFILES))
@pytest.mark.parametrize("nodes", [1, 2])
def test_every_profile_renders_valid_bash(cluster, nodes, tmp_path):
    prof = PROFILES[cluster]
    if prof.get("max_nodes") and nodes > prof["max_nodes"]:
        with pytest.raises(ValueError, match="at most"):
            R.render(cluster, nodes)
        return
    text = R.render(cluster, nodes, time="00:30:00", config="configs/x.toml")
    script = tmp_path / "job.sh"
    script.write_text(text)
    res = subprocess.run([BASH, "-n", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    r, t = _layout(prof)
    # headers
    assert text.startswith("#!/usr/bin/env bash\n")
    assert f"#SBATCH -N {nodes}\n" in text
    assert f"#SBATCH --ntasks-per-node={r}\n" in text
    assert f"#SBATCH --cpus-per-task={t * prof['hw_threads_per_core']}\n" in text
    assert "#SBATCH -t 00:30:00\n" in text
    assert "#SBATCH --signal=B:USR1@120\n" in text
    # threads
    assert f"export OMP_NUM_THREADS={t}\n" in text
    assert "export OMP_PROC_BIND=close\n" in text and "export OMP_PLACES=cores\n" in text
    assert f'deepfusion train "$CONFIG" --set parallel.threads_per_rank={t}' in text
    # binding flags of the launcher
    launcher = prof["launcher"]
    if launcher == "mpiexec":
        need = ["I_MPI_PIN_DOMAIN=omp"] if prof["mpi_impl"] == "intel" else [f"-bind-to core:{t}", f"-ppn {r}"]
    else:
        need = BINDING[launcher]
    for flag in need:
        assert flag in text, (cluster, flag)
    # requeue pattern
    assert "trap 'forward_signal USR1' USR1" in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert '[ -d "$RUN_DIR/checkpoints" ]' in text and 'RESUME=(--resume "$RUN_DIR")' in text
    assert '"$rc" -eq 99' in text


def test_launcher_specific_details():
    s2 = R.render("stampede2", 4)
    assert "#SBATCH -n 32\n" in s2 and "#SBATCH -p skx-normal" in s2 and "scancel --signal" in s2
    ompi = R.render("openmpi", 2, ranks_per_node=4, threads_per_rank=12)
    assert "mpirun -np 8 --map-by ppr:2:package:PE=12 --bind-to core" in ompi
    odd = R.render("openmpi", 1, ranks_per_node=3, threads_per_rank=4)
    assert "--map-by ppr:3:node:PE=4" in odd
    aws = R.render("aws-c5n", 2)  # 2 hyper-threads per core: reserve whole cores
    assert "--cpus-per-task=18" in aws and "export OMP_NUM_THREADS=9" in aws
    smt = R.render("stampede2", 1, ranks_per_node=8, threads_per_rank=12, allow_smt=True)  # the talk's layout
    assert "export OMP_PLACES=threads" in smt and "I_MPI_PIN_CELL=unit" in smt
    assert "--set data.global_batch=1024" in R.render("local", 1, 1, 1, extra_sets=("data.global_batch=1024",))


def test_oversubscribed_layout_rejected_with_both_numbers():
    with pytest.raises(ValueError) as e:
        R.render("stampede2", 1, ranks_per_node=8, threads_per_rank=12)
    msg = str(e.value)
    assert "96" in msg and "48" in msg and "--allow-smt" in msg
    with pytest.raises(ValueError, match="oversubscribed"):
        R.render("azure-hc44", 1, ranks_per_node=4, threads_per_rank=12)
    cores = PROFILES["local"]["cores_per_node"]
    assert R.main(["--cluster", "local", "--ranks-per-node", str(cores), "--threads-per-rank", "2"]) == 2


def test_unknown_cluster_lists_valid_names(capsys):
    with pytest.raises(ValueError) as e:
        R.render("stampede3", 1)
    for name in ("stampede2", "azure-hc44", "aws-c5n", "generic-slurm", "openmpi", "mpich", "local"):
        assert name in str(e.value)
    assert R.main(["--cluster", "nope"]) == 2
    assert "valid clusters" in capsys.readouterr().err


def _write_profile(tmp_path, drop=None, **override):
    base = dict(launcher='"srun"', cores_per_node=16, sockets=2, numa_domains=2, memory_gb=64,
                link_bandwidth_GBps=12.5, link_latency_us=1.5, ranks_per_node=2, threads_per_rank=8,
                partition='"p"', account='"a"', modules="[]")
    base.update(override)
    if drop:
        base.pop(drop)
    f = tmp_path / "mine.toml"
    f.write_text("[mycluster]\n" + "".join(f"{k} = {v}\n" for k, v in base.items()))
    return f


def test_user_profile_file_extends_and_overrides(tmp_path):
    f = _write_profile(tmp_path)
    f.write_text(f.read_text() + '\n[stampede2]\npartition = "skx-dev"\n')
    text = R.render("mycluster", 2, profiles=str(f))
    assert "--cpus-per-task=8" in text and "#SBATCH -p p\n" in text
    assert "#SBATCH -p skx-dev" in R.render("stampede2", 1, profiles=str(f))


def test_srun_mpi_field_sets_the_pmi_plugin(tmp_path):
    """srun_mpi = "pmi2" adds --mpi=pmi2 (the pip mpich needs it under srun: measured by
    tests/test_slurm_jobs.py); unset, srun uses the cluster's MpiDefault."""
    text = R.render("mycluster", 1, profiles=str(_write_profile(tmp_path, srun_mpi='"pmi2"')))
    assert "--kill-on-bad-exit=1 --mpi=pmi2 " in text
    assert "--mpi=" not in R.render("generic-slurm", 1)
    with pytest.raises(ValueError, match="'srun_mpi' must be an srun --mpi type"):
        R.load_profiles(_write_profile(tmp_path, srun_mpi='"pmi 2"'))


@pytest.mark.parametrize("field", ["cores_per_node", "launcher", "link_latency_us", "modules"])
def test_profile_missing_field_rejected(tmp_path, field, capsys):
    f = _write_profile(tmp_path, drop=field)
    with pytest.raises(ValueError, match=f"'mycluster'.*missing field '{field}'"):
        R.load_profiles(f)
    assert R.main(["--cluster", "mycluster", "--profiles", str(f)]) == 2
    assert f"missing field '{field}'" in capsys.readouterr().err


@pytest.mark.parametrize("override,pat", [
    (dict(cores_per_node='"sixteen"'), "'cores_per_node' must be int"),
    (dict(link_bandwidth_GBps="-1"), "'link_bandwidth_GBps' must be > 0"),
    (dict(launcher='"aprun"'), "'launcher' must be one of"),
    (dict(cores_per_nodes=16), "unknown field"),
])
def test_profile_mistyped_field_rejected(tmp_path, override, pat):
    with pytest.raises(ValueError, match=pat):
        R.load_profiles(_write_profile(tmp_path, **override))


SITE = ["--partition", "cpu", "--account", ""]  # generic-slurm's placeholders, set
BURGERS = str(ROOT / "configs" / "burgers.toml")  # global batch 32


def test_cli_writes_file(tmp_path):
    out = tmp_path / "job.sh"
    assert R.main(["--cluster", "generic-slurm", *SITE, "--nodes", "4", "--time", "12:00:00",
                   "--config", BURGERS, "--out", str(out)]) == 0
    assert "#SBATCH -N 4" in out.read_text() and os.access(out, os.X_OK)
    assert R.main(["--cluster", "generic-slurm", *SITE, "--time", "noon", "--config", BURGERS]) == 2


def _fake_job(tmp_path, scontrol_rc=0):
    """The rendered local script around a fake trainer (checkpoints and exits 99 on USR1/TERM) and
    a fake scontrol that logs its arguments (and exits scontrol_rc); returns (script, env, run_dir)."""
    mpiexec = Path(find_mpiexec())  # the launcher every other MPI test uses (venv's, else PATH's)
    assert mpiexec.is_file(), f"no mpiexec found ({mpiexec})"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "fakedf"
    fake.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import json, os, signal, sys, time
        run_dir = [a.split("=", 1)[1] for a in sys.argv if a.startswith("run.dir=")][0]
        with open(os.path.join(run_dir, "calls.log"), "a") as f:
            f.write(json.dumps(dict(argv=sys.argv[1:], omp=os.environ.get("OMP_NUM_THREADS"))) + "\\n")
        def on_signal(*_):
            os.makedirs(os.path.join(run_dir, "checkpoints"), exist_ok=True)
            sys.exit(99)
        signal.signal(signal.SIGUSR1, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        open(os.path.join(run_dir, "ready"), "w").close()
        time.sleep(float(os.environ.get("FAKE_SLEEP", "30")))
        """))
    (bindir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/scontrol.log\nexit {scontrol_rc}\n")
    for f in bindir.iterdir():
        f.chmod(0o755)
    run_dir = tmp_path / "run"
    script = tmp_path / "job.sh"
    script.write_text(R.render("local", 1, 1, 1, deepfusion=str(fake), run_dir=str(run_dir)))
    env = dict(os.environ, PATH=f"{mpiexec.parent}:{bindir}:{os.environ['PATH']}", SLURM_JOB_ID="4242")
    return script, env, run_dir


def _signal_when_ready(script, env, run_dir, sig):
    proc = subprocess.Popen([BASH, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t0 = time.time()
    while not (run_dir / "ready").exists():
        assert time.time() - t0 < 20, "fake training never started"
        time.sleep(0.1)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
    return proc.returncode, out


@pytest.mark.mpi
def test_requeue_pattern_end_to_end(tmp_path):
    """The rendered local script under real mpiexec: USR1 -> checkpoint (exit 99) -> scontrol requeue;
    the next start passes --resume RUN_DIR. (tests/test_slurm_jobs.py does the same under real Slurm.)"""
    script, env, run_dir = _fake_job(tmp_path)
    rc, out = _signal_when_ready(script, env, run_dir, signal.SIGUSR1)
    assert rc == 0, out
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    first = json.loads((run_dir / "calls.log").read_text().splitlines()[0])
    assert "--resume" not in first["argv"] and first["omp"] == "1"
    env["FAKE_SLEEP"] = "0.2"
    res = subprocess.run([BASH, str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    second = json.loads((run_dir / "calls.log").read_text().splitlines()[-1])
    assert second["argv"][-2:] == ["--resume", str(run_dir)]


@pytest.mark.mpi
def test_term_keeps_the_checkpoint_but_never_requeues(tmp_path):
    """TERM is what `scancel` sends: the step checkpoints, the script exits 99 and does not call
    `scontrol requeue` (which would undo the cancel: seen under real Slurm before this rule)."""
    script, env, run_dir = _fake_job(tmp_path)
    rc, out = _signal_when_ready(script, env, run_dir, signal.SIGTERM)
    assert rc == 99, out
    assert not (tmp_path / "scontrol.log").exists(), out
    assert "not requeued" in out and (run_dir / "checkpoints").is_dir()


@pytest.mark.mpi
def test_failed_requeue_is_an_error_not_a_success(tmp_path):
    """If `scontrol requeue` fails (job submitted with --no-requeue, JobRequeue=0), the script says
    so and exits 99 rather than 0, so the job does not look COMPLETED with training unfinished."""
    script, env, run_dir = _fake_job(tmp_path, scontrol_rc=1)
    rc, out = _signal_when_ready(script, env, run_dir, signal.SIGUSR1)
    assert rc == 99, out
    assert "scontrol requeue 4242 failed" in out and (run_dir / "checkpoints").is_dir()


# ----------------------------------------------------------------------------- sweep
def _metrics(path: Path, step_times, allreduce, global_batch, epochs=()):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i, (ts, ar) in enumerate(zip(step_times, allreduce)):
            f.write(json.dumps(dict(kind="step", step=i, loss=1.0 / (i + 1), time_step=ts, time_allreduce=ar,
                                    samples_per_s=global_batch / ts)) + "\n")
        f.write("not json\n")
        for i, te in enumerate(epochs):
            f.write(json.dumps(dict(kind="epoch", epoch=i, time_epoch=te, samples_per_s=1.0)) + "\n")
    return path


def test_parse_and_check_layouts():
    assert S.parse_layouts("1x2, 2x1,4x1") == [(1, 2), (2, 1), (4, 1)]
    for bad in ("2", "2x", "0x1", "axb", ""):
        with pytest.raises(ValueError):
            S.parse_layouts(bad)
    S.check_layouts([(1, 2), (2, 1)], 2)
    with pytest.raises(ValueError, match="2x2 needs 4 cores but only 2"):
        S.check_layouts([(2, 2)], 2)
    S.check_layouts([(2, 2)], 2, oversubscribe=True)
    assert S.main(["--config", "c.toml", "--layouts", "64x64", "--out", "/tmp/never"]) == 2


def test_sweep_aggregation_strong(tmp_path):
    gb = 64
    warm = [5.0, 3.0]  # warm-up steps are skipped
    runs = []
    # 1x1: 1.0 s/step; 1x2: 0.6 s (threads); 2x1: 0.5 s with 0.05 s allreduce; 2x2: 0.3 s
    for (r, t), ts, ar in [((1, 1), 1.0, 0.0), ((1, 2), 0.6, 0.0), ((2, 1), 0.5, 0.05), ((2, 2), 0.3, 0.06)]:
        m = _metrics(tmp_path / f"{r}x{t}" / "metrics.jsonl", warm + [ts * 0.9, ts, ts * 1.1, ts, ts * 5.0],
                     [0.0, 0.0] + [ar] * 5, gb, epochs=[99.0, 40.0, 42.0])
        runs.append(dict(ranks=r, threads=t, global_batch=gb, metrics=m))
    runs.append(dict(ranks=4, threads=1, global_batch=gb, metrics=tmp_path / "missing.jsonl"))
    rows = S.aggregate(runs, samples_per_epoch=4096, warmup=2)
    by = {(x["ranks"], x["threads"]): x for x in rows}
    assert by[(1, 1)]["median_time_step"] == pytest.approx(1.0)
    assert by[(1, 1)]["efficiency"] == pytest.approx(1.0) and by[(1, 1)]["baseline"] == "1n1x1"
    assert by[(1, 2)]["speedup"] == pytest.approx(1 / 0.6)
    assert by[(1, 2)]["efficiency"] == pytest.approx(1 / 0.6 / 2)
    assert by[(2, 1)]["efficiency"] == pytest.approx(1.0)
    assert by[(2, 1)]["vs_threads_only"] == pytest.approx(0.6 / 0.5)
    assert by[(2, 2)]["efficiency"] == pytest.approx(1 / 0.3 / 4)
    assert by[(2, 1)]["samples_per_s"] == pytest.approx(128.0)
    assert by[(2, 1)]["time_epoch_est"] == pytest.approx(64 * 0.5)
    assert by[(2, 1)]["time_epoch_measured"] == pytest.approx(41.0)  # first epoch skipped
    share = 0.05 * 5 / (0.5 * (0.9 + 1 + 1.1 + 1 + 5))
    assert by[(2, 1)]["allreduce_share"] == pytest.approx(share)
    assert by[(4, 1)]["status"] == "no metrics" and by[(4, 1)]["efficiency"] is None

    S.write_outputs(rows, tmp_path / "out", dict(mode="strong"))
    doc = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert len(doc["layouts"]) == 5 and "efficiency" in doc["definitions"]
    with open(tmp_path / "out" / "sweep.csv") as f:
        table = list(csv.DictReader(f))
    assert table[2]["ranks"] == "2" and float(table[2]["efficiency"]) == pytest.approx(1.0)
    assert (tmp_path / "out" / "sweep.png").stat().st_size > 1000


def test_sweep_aggregation_weak_and_multi_rank_records(tmp_path):
    # weak scaling: local batch 16, P=2 -> global 32; two ranks log each step: the slowest rank counts
    m1 = _metrics(tmp_path / "a.jsonl", [1.0] * 6, [0.0] * 6, 16)
    m2 = tmp_path / "b.jsonl"
    with open(m2, "w") as f:
        for i in range(6):
            for rank, ts in ((0, 1.2), (1, 1.25)):
                f.write(json.dumps(dict(kind="step", step=i, rank=rank, time_step=ts, time_allreduce=0.1,
                                        samples_per_s=32 / ts)) + "\n")
    rows = S.aggregate([dict(ranks=1, threads=1, global_batch=16, metrics=m1),
                        dict(ranks=2, threads=1, global_batch=32, metrics=m2)], 4096, warmup=2, mode="weak")
    assert rows[1]["median_time_step"] == pytest.approx(1.25)
    assert rows[1]["efficiency"] == pytest.approx(1.0 / 1.25)  # weak: t_step(base) / t_step
    assert rows[1]["local_batch"] == 16 and rows[1]["steps_measured"] == 4


def test_sweep_aggregate_only_cli(tmp_path):
    for (r, t), ts in [((1, 1), 2.0), ((1, 2), 1.2), ((2, 1), 1.1)]:
        _metrics(tmp_path / "runs" / f"1n{r}x{t}" / "metrics.jsonl", [ts] * 8, [0.0] * 8, 64)
    assert S.main(["--aggregate-only", "--out", str(tmp_path), "--global-batch", "64"]) == 0
    doc = json.loads((tmp_path / "sweep.json").read_text())
    eff = {(x["ranks"], x["threads"]): x["efficiency"] for x in doc["layouts"]}
    assert eff[(2, 1)] == pytest.approx(2.0 / 1.1 / 2)


def _sweep(tmp_path, times: dict, mode="strong") -> Path:
    """A sweep.json as ``jobs sweep`` writes it, from step times per (ranks, threads)."""
    runs = [dict(ranks=r, threads=t, global_batch=64,
                 metrics=_metrics(tmp_path / "runs" / f"1n{r}x{t}" / "metrics.jsonl", [ts] * 8, [0.0] * 8, 64))
            for (r, t), ts in times.items()]
    S.write_outputs(S.aggregate(runs, 4096, mode=mode), tmp_path, dict(mode=mode, host_cores=2))
    return tmp_path / "sweep.json"


def test_layout_from_a_sweep_takes_the_fastest_measured_layout(tmp_path, capsys):
    """jobs render --layout-from: the one-node layout with the most samples/s (ties: fewer
    ranks), said on stderr; a sweep from another kind of host is a warning, a weak-scaling
    sweep, a missing file or an explicit layout beside it are errors."""
    from deepfusion.jobs.pick import fastest_layout, load_sweep

    sweep = _sweep(tmp_path / "a", {(1, 2): 1.2, (2, 1): 1.1, (1, 1): 2.0})
    assert fastest_layout(load_sweep(sweep), sweep)[:2] == (2, 1)
    tie = _sweep(tmp_path / "b", {(2, 1): 1.1, (1, 2): 1.1})
    assert fastest_layout(load_sweep(tie), tie)[:2] == (1, 2)
    out = tmp_path / "job.sh"
    assert R.main(["--cluster", "local", "--layout-from", str(sweep), "--config", BURGERS, "--out", str(out)]) == 0
    assert "mpiexec -n 2 -ppn 2 -bind-to core:1" in out.read_text()
    err = capsys.readouterr().err
    assert "2x1 (ranks x threads), 58.2 samples/s" in err and "against 1x2 53.3, 1x1 32.0" in err
    assert R.main(["--cluster", "generic-slurm", *SITE, "--layout-from", str(sweep), "--config", BURGERS,
                   "--out", str(out)]) == 0
    assert "warning: the sweep" in capsys.readouterr().err  # 2 cores measured, not the profile's
    weak = _sweep(tmp_path / "c", {(1, 2): 1.2, (2, 1): 1.1}, mode="weak")
    for argv, words in ((["--layout-from", str(weak)], "--mode strong"),
                        (["--layout-from", str(tmp_path / "none.json")], "cannot read"),
                        (["--layout-from", str(sweep), "--ranks-per-node", "1"], "drop --ranks-per-node")):
        assert R.main(["--cluster", "local", *argv]) == 2
        assert words in capsys.readouterr().err


def test_sweep_commands():
    cmd = S.build_command(2, 1, 1, "c.toml", Path("/r"), 64, 10, launcher="mpiexec")
    assert cmd[:5] == ["mpiexec", "-n", "2", "-bind-to", "core:1"]
    assert "parallel.threads_per_rank=1" in cmd and "data.global_batch=64" in cmd and "train.max_steps=10" in cmd
    assert "-bind-to" not in S.build_command(2, 2, 1, "c.toml", Path("/r"), 64, 10, "mpiexec", oversubscribe=True)
    prof = R.get_profile("openmpi", PROFILES)
    cmd = S.build_command(4, 12, 2, "c.toml", Path("/r"), 64, 10, profile=prof)
    assert cmd[:6] == ["mpirun", "-np", "8", "--map-by", "ppr:2:package:PE=12", "--bind-to"]


@pytest.mark.mpi
@pytest.mark.full
def test_sweep_end_to_end_p1_p2(tmp_path):
    """Real `deepfusion train` (python -m deepfusion) under mpiexec at P=1 and P=2 through the
    sweep driver (tiny Burgers problem): both layouts run, and the aggregation reports positive
    step times, efficiency 1 for the baseline and a non-zero allreduce share at P=2."""
    config = tmp_path / "tiny.toml"
    config.write_text('[problem]\nname = "burgers"\ngrid = [32, 32]\n\n'
                      '[data]\nn_samples = 32\nglobal_batch = 4\neval_samples = 0\n\n[train]\nepochs = 100\n')
    out = tmp_path / "sweep"
    rc = S.main(["--config", str(config), "--layouts", "1x1,2x1", "--mode", "strong", "--steps", "5",
                 "--warmup", "1", "--global-batch", "4", "--out", str(out), "--timeout", "120"])
    doc = json.loads((out / "sweep.json").read_text())
    logs = {p.parent.name: p.read_text()[-2000:] for p in out.glob("runs/*/stdout.log")}
    assert rc == 0, (doc["layouts"], logs)
    rows = {(r["ranks"], r["threads"]): r for r in doc["layouts"]}
    assert set(rows) == {(1, 1), (2, 1)}
    for row in rows.values():
        assert row["median_time_step"] > 0 and row["samples_per_s"] > 0
        assert row["steps_measured"] == 5 - 1  # --steps 5 logged every step, --warmup 1 dropped
    assert rows[(1, 1)]["efficiency"] == pytest.approx(1.0)
    assert rows[(2, 1)]["allreduce_share"] > 0
    assert (out / "sweep.png").exists() and (out / "sweep.csv").exists()
