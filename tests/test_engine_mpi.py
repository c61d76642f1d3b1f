"""The engine with real processes: mpiexec -n 2 and -n 4 (oversubscribed on 2 cores: tiny)."""
import json
import os

import pytest

from deepfusion.engine.checkpoint import store as ckpt
from tests.faults.steps import fault_env
from tests.in_process import deepfusion_here
from tests.mpi_util import deepfusion, run_mpi
from tests.tiny_configs import TINY, variant
from tests.tiny_runs import trained

pytestmark = pytest.mark.mpi


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    return str(path)


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [json.loads(l) for l in f]
    return [r["loss"] for r in recs if r["kind"] == "step"]


def train(n, config, run_dir, *extra, **kw):
    """``deepfusion train CONFIG`` with ``--set``s on n ranks (0: a plain process, no launcher;
    None: in this process, for a one-process run that is not itself under test)."""
    args = ["train", config, "--set", f"run.dir={run_dir}"] + [a for s in extra for a in ("--set", s)]
    return deepfusion_here(args) if n is None else deepfusion(n, args, **kw)


@pytest.mark.parametrize("n,variants", [
    (2, ["plain", "overlap", "micro", "channels-last", "channels-last+overlap"]),
    pytest.param(4, ["overlap", "channels-last"], marks=pytest.mark.full)])
def test_allreduced_gradient_equals_full_batch_gradient(n, variants):
    """Reduced after backward, during it (overlap), and over micro-batches of 1: the same
    gradient as one process over the whole global batch (float64, rtol 1e-10; several small
    buckets). Also with channels_last models and inputs (the default model.channels_last =
    true path; the other multi-rank tests run NCHW): there the script also checks that every
    instance norm took the NHWC kernel and that the bucketed 4-D gradients kept the weights'
    channels_last strides. The variants share a launch."""
    p = run_mpi(n, ["tests/mpi_scripts/grad_check.py"] + variants)
    assert p.returncode == 0, p.stderr
    for v in variants:
        layout = "channels-last" in v.split("+")
        assert f"OK P={n} variant={v} channels_last={layout} " in p.stdout, p.stdout


def losses_on_every_p(tmp_path_factory, config: str, ranks=(0, 2, 4)) -> dict:
    """Train the TOML text ``config`` on each number of ranks (0: a plain process without any
    launcher; runs shared with other files, tests/tiny_runs.py); assert every run logs the same
    losses (float64, rtol 1e-9) and that the loss falls. Returns {ranks: run directory}."""
    runs = {n: trained(tmp_path_factory, config, n) for n in ranks}
    first = losses(runs[ranks[0]])
    for n in ranks[1:]:
        got = losses(runs[n])
        assert len(got) == len(first), (n, got)
        for a, b in zip(first, got):
            assert a == pytest.approx(b, rel=1e-9), (n, first, got)
    assert first[-1] < first[0]
    return runs


def test_same_losses_for_any_number_of_ranks(tmp_path_factory):
    runs = losses_on_every_p(tmp_path_factory, TINY)
    assert len(losses(runs[0])) == 20
    d = runs[2]
    for name in ("config.toml", "eval.json"):
        assert os.path.exists(os.path.join(d, name)), name
    for name in ("loss.png", "eval.png"):  # run.plots = false (drawn in test_3d, test_multigrid)
        assert not os.path.exists(os.path.join(d, name)), name


# LAMB, its weight decay decoupled; its lr is relative (each tensor moves by lr x its norm)
LAMB = variant(TINY, "optim.name=\"lamb\"", "optim.lr=1e-2", "optim.weight_decay=1e-3")


@pytest.mark.full
def test_lamb_same_losses_on_1_and_2_ranks_and_a_resume_continues_bit_for_bit(tmp_path_factory,
                                                                              tmp_path):
    """LAMB's trust ratios come from the all-reduced gradient every rank holds, so P = 1 and 2
    take the same steps; a run stopped after step 1 (its checkpoint holds LAMB's moments and step
    count) and resumed gives the uninterrupted one-process run's losses, bit for bit."""
    runs = losses_on_every_p(tmp_path_factory, LAMB, ranks=(0, 2))
    cfg, d = tmp_path / "lamb.toml", str(tmp_path / "cut")
    cfg.write_text(LAMB)
    p = train(None, str(cfg), d, "train.time_limit_minutes=1e-9")
    assert p.returncode == 99, p.stderr
    st = ckpt.load_checkpoint(os.path.join(d, "checkpoints", "step_00000001.h5"))
    assert st["meta"]["optimizer"] == "lamb" and float(st["optim_state"]["state"][0]["step"]) == 1
    p = deepfusion_here(["train", "--resume", d, "--set", "train.time_limit_minutes=0"])
    assert p.returncode == 0, p.stderr
    assert losses(d) == losses(runs[0])


def test_failing_rank_ends_the_whole_job(tiny, tmp_path):
    p = train(2, tiny, str(tmp_path / "r"), env=fault_env("raise@4:1"), timeout=120)
    assert p.returncode != 0
    assert "error on rank 1" in p.stderr and "InjectedFailure" in p.stderr


def test_bad_config_rejected_cleanly_under_mpiexec(tiny, tmp_path):
    p = train(2, tiny, str(tmp_path / "r"), "optim.lrr=1")
    assert p.returncode == 2
    assert "optim.lr" in p.stderr and p.stderr.count("deepfusion: error") == 1
    p = train(4, tiny, str(tmp_path / "r"), "data.global_batch=6")
    assert p.returncode == 2
    assert "not divisible" in p.stderr and "4" in p.stderr and "8" in p.stderr


@pytest.mark.full
def test_nonfinite_loss_stops_all_ranks(tiny, tmp_path):
    p = train(2, tiny, str(tmp_path / "r"), "optim.name=\"sgd\"", "optim.lr=1e12", "train.dtype=\"float32\"")
    assert p.returncode == 3, p.stderr
    assert "non-finite loss at step" in p.stderr


@pytest.mark.full
def test_stop_signal_checkpoints_then_resume(tiny, tmp_path):
    """SIGUSR1 to the launcher (SLURM's time-limit warning): every rank stops after the same step,
    a checkpoint is written, exit code 99; --resume finishes the run."""
    import signal
    import subprocess
    import sys
    import time

    from tests.mpi_util import ROOT, mpiexec

    d = str(tmp_path / "sig")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "deepfusion", "train", tiny,
           "--set", f"run.dir={d}", "--set", "train.epochs=1000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    metrics = os.path.join(d, "metrics.jsonl")
    deadline = time.monotonic() + 180  # hang guard only
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.exists(metrics) and len(open(metrics).readlines()) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 99, err
    assert "checkpoint written at step" in err
    n_done = len(losses(d))
    assert os.listdir(os.path.join(d, "checkpoints")) == [f"step_{n_done:08d}.h5"]
    p = deepfusion(2, ["train", "--resume", d, "--set", "train.max_steps=" + str(n_done + 3)])
    assert p.returncode == 0, p.stderr
    assert len(losses(d)) == n_done + 3


def test_time_limit_checkpoints_and_the_segments_make_the_uninterrupted_run(tiny, tmp_path,
                                                                         tmp_path_factory):
    """train.time_limit_minutes (for launchers that send no signal): every rank stops after the
    same step with a checkpoint and exit 99, as on SIGUSR1; segments resumed under a limit
    again and then without one give the uninterrupted run's losses, step for step."""
    whole = trained(tmp_path_factory, TINY, 2)
    d = str(tmp_path / "seg")
    p = train(2, tiny, d, "train.time_limit_minutes=1e-9")  # the limit has passed at step 1
    assert p.returncode == 99, p.stderr
    assert "train.time_limit_minutes = 1e-09 reached: checkpoint written at step 1" in p.stderr
    assert os.listdir(os.path.join(d, "checkpoints")) == ["step_00000001.h5"]
    p = deepfusion(2, ["train", "--resume", d, "--set", "train.time_limit_minutes=1e-9"])
    assert p.returncode == 99 and "written at step 2" in p.stderr, p.stderr
    p = deepfusion(2, ["train", "--resume", d, "--set", "train.time_limit_minutes=0"])
    assert p.returncode == 0, p.stderr
    assert losses(d) == losses(whole) and len(losses(d)) == 20


def test_metrics_hold_epoch_and_eval_records(tiny, tmp_path):
    d = str(tmp_path / "m")
    p = train(None, tiny, d, "train.eval_every_epochs=2")
    assert p.returncode == 0, p.stderr
    with open(os.path.join(d, "metrics.jsonl")) as f:
        recs = [json.loads(l) for l in f]
    epochs = [r for r in recs if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [0, 1, 2, 3, 4]
    assert all(r["time_epoch"] > 0 and r["samples_per_s"] > 0 for r in epochs)
    assert [r["epoch"] for r in recs if r["kind"] == "eval"] == [1, 3]
    step = [r for r in recs if r["kind"] == "step"][0]
    for key in ("loss", "pde", "bc", "grad_norm", "lr", "time_data", "time_forward", "time_backward",
                "time_allreduce", "time_optimizer", "time_step", "samples_per_s"):
        assert key in step, key
