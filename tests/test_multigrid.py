"""Multigrid schedules (train.levels): the visit order of each cycle, the plan, bad schedules
refused before training with the level named, and with real processes: the same losses on any
P across level changes, a kill mid-level and SIGUSR1 resumed on the same trajectory, a
checkpoint at a level boundary, the level and grid in the metrics. Tiny grids 16 -> 32 -> 64."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from deepfusion.engine.predict.loader import load_model
from deepfusion.config import ConfigError, load_config
from deepfusion.engine.checkpoint.store import latest_checkpoint
from tests.faults.steps import fault_env
from deepfusion.engine.train.plan import plan, visit_at, visit_order
from tests.mpi_util import HANG_GUARD, ROOT, deepfusion, mpiexec
from tests.test_engine_mpi import losses, train
from tests.tiny_configs import TINY, variant

# 16 -> 32 -> 64, coarse to fine: steps, then an epoch at its own batch, then steps at its own rate
MG = variant(TINY, "problem.grid=[64, 64]", 'optim.schedule="cosine"', "optim.warmup_steps=1",
             "train.log_every=1", "train.checksum_every=3", 'train.cycle="half-v"',
             "train.levels=[{grid = [16, 16], steps = 5}, "
             "{grid = [32, 32], epochs = 1, global_batch = 8}, "
             "{grid = [64, 64], steps = 4, optim = {lr = 1e-3}}]", drop=("train.epochs",))


@pytest.fixture(scope="module")
def mg(tmp_path_factory):
    path = tmp_path_factory.mktemp("mg") / "mg.toml"
    path.write_text(MG)
    return str(path)


@pytest.fixture(scope="module")
def full(mg, tmp_path_factory):
    """The uninterrupted P = 2 run of ``mg`` (once for the module): (run dir, stdout)."""
    d = str(tmp_path_factory.mktemp("full") / "run")
    p = train(2, mg, d, "run.plots=true")  # its loss.png marks the level changes
    assert p.returncode == 0, p.stderr[-3000:]
    return d, p.stdout


def records(run_dir, kind):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


# -- the plan (no processes) --------------------------------------------------------------------

def test_cycles_visit_the_levels_in_the_multigrid_order():
    assert visit_order(3, "") == [0, 1, 2]
    assert visit_order(3, "half-v") == [0, 1, 2]
    assert visit_order(3, "v") == [2, 1, 0, 1, 2]
    assert visit_order(3, "f") == [2, 1, 0, 1, 0, 1, 2]
    assert visit_order(4, "f") == [3, 2, 1, 0, 1, 0, 1, 2, 1, 0, 1, 2, 3]
    assert visit_order(2, "v") == [1, 0, 1]


def test_plan_lengths_batches_optimisers_and_data_order(mg):
    cfg = load_config(mg)
    v = plan(cfg)
    assert [(x.grid, x.start, x.steps, x.global_batch) for x in v] == [
        ((16, 16), 0, 5, 4), ((32, 32), 5, 2, 8), ((64, 64), 7, 4, 4)]
    assert [x.optim.lr for x in v] == [3e-3, 3e-3, 1e-3]
    # the data order continues: 5 steps of 4 per epoch -> 2 epochs used, then 1, then 1
    assert [x.epoch_base for x in v] == [0, 2, 3]
    assert v[0].epoch_of(4) == (1, 0) and v[1].epoch_of(5) == (2, 0)
    assert visit_at(v, 6).level == 1 and visit_at(v, 7).level == 2
    cut = plan(load_config(mg, ["train.max_steps=6"]))
    assert [(x.level, x.steps) for x in cut] == [(0, 5), (1, 1)]
    f = plan(load_config(mg, ['train.cycle="f"']))
    assert [x.level for x in f] == [2, 1, 0, 1, 0, 1, 2] and f[-1].end == 4 + 2 + 5 + 2 + 5 + 2 + 4


def test_without_levels_the_plan_is_the_single_grid_run(mg):
    cfg = load_config(mg, ["train.levels=[]", 'train.cycle=""', "train.epochs=3"])
    (v,) = plan(cfg)
    assert (v.grid, v.start, v.steps, v.epoch_base, v.optim) == ((64, 64), 0, 12, 0, cfg.optim)


@pytest.mark.parametrize("sets, key, needle", [
    (["train.levels=[{grid=[16,16]}]", 'problem.grid=[16,16]', 'train.cycle=""'],
     "train.levels[0].steps", "zero length"),
    (["train.levels=[{grid=[16,16], steps=1, epochs=2}]", 'problem.grid=[16,16]',
      'train.cycle=""'], "train.levels[0].steps", "exactly one length"),
    (["train.levels=[{grid=[16,16], steps=1}, {grid=[32,32], steps=1, optim={lr=0}}]",
      'problem.grid=[32,32]'], "train.levels[1].optim.lr", "> 0"),
    (["train.levels=[{grid=[16,16], steps=1, gird=1}]", 'problem.grid=[16,16]',
      'train.cycle=""'], "train.levels[0].gird", "valid keys"),
    (["train.levels=[{grid=[32,32], steps=1}, {grid=[16,16], steps=1}]",
      'problem.grid=[16,16]'], "train.levels[1].grid", "coarse to fine"),
    (["problem.grid=[128,128]"], "problem.grid", "last level trains on [64, 64]"),
    (['train.cycle="w"'], "train.cycle", "one of"),
    (["train.levels=[{grid=[16,16], steps=1, global_batch=32}, {grid=[64,64], steps=1}]"],
     "train.levels[0].global_batch", "n_samples"),
    (['train.levels[1].progress="visit"'], "train.levels[1].progress", "'level'"),
])
def test_bad_schedules_are_refused_with_the_level_named(mg, sets, key, needle):
    with pytest.raises(ConfigError) as e:
        load_config(mg, sets)
    assert e.value.key == key and needle in str(e.value), str(e.value)


@pytest.mark.mpi
def test_a_level_the_network_or_the_ranks_cannot_take_is_refused_before_training(mg, tmp_path):
    d = str(tmp_path / "r")
    p = train(2, mg, d, "train.levels[1]={grid=[34,34], epochs=1}")
    assert p.returncode == 2 and "train.levels[1].grid = [34, 34]" in p.stderr, p.stderr
    assert "divisible by 2**depth" in p.stderr and not os.path.exists(d)
    p = train(4, mg, d, "train.levels[1]={grid=[32,32], steps=2, global_batch=6}",
              "data.n_samples=24")
    assert p.returncode == 2 and "train.levels[1] (grid [32, 32])" in p.stderr, p.stderr
    assert "not divisible" in p.stderr and not os.path.exists(d)


# -- real processes ---------------------------------------------------------------------------

@pytest.mark.mpi
def test_same_losses_on_any_p_across_level_changes(mg, full, tmp_path):
    d, out = full
    runs = {2: losses(d)}
    for n in (0,):  # P = 4 (oversubscribed, slow): tests/test_engine_mpi.py, test_elastic.py
        p = train(n, mg, str(tmp_path / f"p{n}"))
        assert p.returncode == 0, p.stderr[-3000:]
        runs[n] = losses(str(tmp_path / f"p{n}"))
    assert len(runs[2]) == 11
    for n in (0,):
        assert runs[n] == pytest.approx(runs[2], rel=1e-9, abs=0), n
    steps = records(d, "step")
    assert [(r["level"], r["grid"]) for r in steps] == \
        [(0, [16, 16])] * 5 + [(1, [32, 32])] * 2 + [(2, [64, 64])] * 4
    evals = records(d, "eval")  # the end of every level but the last (the final one: eval.json)
    assert [(e["step"], e["grid"]) for e in evals] == [(5, [16, 16]), (7, [32, 32])]
    assert "entering level 1 (32x32), visit 1: steps 5..6, global batch 8" in out
    assert "   6/11     32x32" in out  # the log line shows step/total and the grid
    assert os.path.exists(os.path.join(d, "loss.png"))


@pytest.mark.mpi
@pytest.mark.full
@pytest.mark.parametrize("every, fail_at, resumed_at", [(3, 8, 6), (5, 7, 5)])
def test_kill_mid_level_resumes_in_the_same_level_on_the_same_trajectory(
        mg, full, tmp_path, every, fail_at, resumed_at):
    """A checkpoint inside level 1 (step 6: its optimiser state restored) and one at the 0 -> 1
    boundary (step 5: the next visit starts with a fresh optimiser);
    a rank dies later (during step ``fail_at``); --resume gives the
    uninterrupted run's losses bit for bit."""
    cut = str(tmp_path / "cut")
    p = train(2, mg, cut, f"train.checkpoint_every={every}", env=fault_env(f"raise@{fail_at}:1"))
    assert p.returncode != 0 and f"injected failure at step {fail_at}" in p.stderr
    # a checkpoint written mid-schedule answers, by default, on the grid it was training on
    newest = latest_checkpoint(cut)
    assert newest.endswith(f"step_{resumed_at:08d}.h5")
    grid = (32, 32) if resumed_at == 6 else (16, 16)  # step 5 closes the 16x16 visit
    assert tuple(load_model(newest)[1].grid) == grid
    p = deepfusion(2, ["train", "--resume", cut])
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"step_{resumed_at:08d}" in p.stdout
    assert losses(cut) == losses(full[0])


@pytest.mark.mpi
@pytest.mark.full
def test_sigusr1_mid_level_checkpoints_and_the_resume_finishes_the_cycle(mg, tmp_path):
    sets = ['train.cycle="v"', "train.levels[0].steps=40"]  # levels 2 1 0 1 2: 4+2+40+2+4
    full, d = str(tmp_path / "full"), str(tmp_path / "sig")
    assert train(2, mg, full, *sets).returncode == 0
    assert [r["level"] for r in records(full, "step")] == [2] * 4 + [1] * 2 + [0] * 40 + \
        [1] * 2 + [2] * 4
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "deepfusion", "train", mg,
           "--set", f"run.dir={d}"] + [a for s in sets for a in ("--set", s)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT)
    metrics = os.path.join(d, "metrics.jsonl")
    deadline = time.monotonic() + HANG_GUARD  # hang guard only
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.exists(metrics) and len(records(d, "step")) >= 9:  # inside the 16x16 visit
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=HANG_GUARD)
    assert proc.returncode == 99, err[-3000:]
    n_done = len(losses(d))
    assert 9 <= n_done < 50
    p = deepfusion(2, ["train", "--resume", d])
    assert p.returncode == 0, p.stderr[-3000:]
    assert losses(d) == losses(full)


@pytest.mark.mpi
@pytest.mark.full
def test_a_changed_plan_is_refused_on_resume(mg, tmp_path):
    d = str(tmp_path / "r")
    p = train(2, mg, d, "train.checkpoint_every=3", env=fault_env("raise@5:1"))
    assert p.returncode != 0
    p = deepfusion(2, ["train", "--resume", d, "--set", "train.levels[0].steps=6"])
    assert p.returncode == 2 and "another level plan" in p.stderr, p.stderr


@pytest.mark.mpi
@pytest.mark.full
def test_a_finished_run_extended_by_a_level_is_the_run_that_listed_it(mg, tmp_path):
    """--resume under a plan that appends a prolonged level to the finished run's plan: the
    network grows at the new level and every loss equals the run that listed all three levels
    from the start; a plan that changes a visit so far is still refused."""
    grown = "train.levels[2].prolong=true"
    whole, ext = str(tmp_path / "whole"), str(tmp_path / "ext")
    assert train(2, mg, whole, grown).returncode == 0
    two = ["train.levels=[{grid=[16,16], steps=5}, {grid=[32,32], epochs=1, global_batch=8}]",
           "problem.grid=[32,32]"]
    p = train(2, mg, ext, *two)
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(losses(ext)) == 7
    p = deepfusion(2, ["train", mg, "--resume", ext, "--set", grown])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "the plan extends the checkpoint's: 1 more visit(s) after its 2, from step 7" in p.stdout
    assert "prolonging the network from 32x32" in p.stdout
    assert losses(ext) == losses(whole) and len(losses(whole)) == 11
    assert load_model(latest_checkpoint(ext))[0].config() == \
        load_model(latest_checkpoint(whole))[0].config()
    p = deepfusion(2, ["train", mg, "--resume", ext, "--set", grown,
                       "--set", "train.levels[1].global_batch=4"])
    assert p.returncode == 2 and "another level plan" in p.stderr, p.stderr


@pytest.mark.full
def test_a_level_can_restart_the_problems_progress(mg, tmp_path):
    """train.levels[2].progress = "level": an annealed smoothing (off after half the run)
    starts again on the 64x64 level, so that level's losses change and the levels before it
    do not; the plan carries the setting."""
    smooth = ('problem.options={scheme="lax-oleinik", smoothing=0.2, smoothing_until=0.5, '
              'hard_bc=true}')
    restart = 'train.levels[2].progress="level"'
    assert [v.progress for v in plan(load_config(mg, [restart]))] == ["run", "run", "level"]
    runs = []
    for extra in ([], [restart]):
        d = str(tmp_path / f"r{len(extra)}")
        p = train(None, mg, d, smooth, *extra)  # in this process: the runs, not the launch
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append(losses(d))
    first = visit_at(plan(load_config(mg)), 10).start  # the 64x64 level's first step
    assert runs[1][:first] == runs[0][:first]
    assert all(a != b for a, b in zip(runs[1][first:], runs[0][first:]))
