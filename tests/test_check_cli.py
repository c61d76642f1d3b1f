"""``deepfusion check CONFIG --ranks P``: train's start-up checks for P ranks in one process,
refused with exactly the message a real ``mpiexec -n P deepfusion train`` prints, and the
measured probe (seconds per step and peak memory per rank of each level)."""
from __future__ import annotations

import json
import statistics
import subprocess
import time

import pytest

from diffnet.problems.families.burgers import Burgers
from tests.mpi_util import REAL_MPI, commands, deepfusion
from tests.tiny_configs import TINY, variant


class LeftBlocksOnly(Burgers):
    """Refuses every block of a split but those at x = 0: a refusal that depends on the rank."""

    def check_block(self, block):
        if block.start[1] > 0:
            raise ValueError(f"this test problem takes no block right of x = 0 (the block at "
                             f"{list(block.start)})")
        super().check_block(block)


class LossFails(Burgers):
    """Builds and checks like Burgers; its loss fails when a step runs (what only the probe sees)."""

    def loss_terms(self, u, inputs):
        raise RuntimeError("this test problem's loss fails at the first step")


def write(tmp_path, *overrides, name="tiny.toml"):
    path = tmp_path / name
    path.write_text(variant(TINY, f"run.dir='{tmp_path / 'run'}'", *overrides))
    return str(path)


def error_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.startswith("deepfusion: error: ")]
    assert lines, err
    return lines[-1]


REFUSALS = {  # name: (--set items, extra args of both commands)
    "unknown key": (["optim.lrr=1"], []),
    "unknown problem": (['problem.name="heat"'], []),
    "problem option": (["problem.options={n_term=4}"], []),
    "model option": (["model.options={depht=4}"], []),
    "grid against depth": (["problem.grid=[50,50]", "train.levels=[]"], []),
    "batch against ranks": (["data.global_batch=3", "data.n_samples=15"], []),
    "domain against ranks": (["parallel.domain=[1,3]"], []),
    "a rank's block": ([f'problem.name="{__name__}:LeftBlocksOnly"', "parallel.domain=[1,2]"], []),
}


def flags_of(case: str) -> list[str]:
    sets, extra = REFUSALS[case]
    return [a for s in sets for a in ("--set", s)] + extra


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """``mpiexec -n 2 deepfusion train`` of every refusal, the commands in one launch (a
    refusal ends the command before training, on every rank): {case: (its directory, the
    config there, train's exit code, train's stderr)}."""
    home, cases = tmp_path_factory.mktemp("refusals"), sorted(REFUSALS)
    configs = {}
    for i, case in enumerate(cases):
        (home / str(i)).mkdir()
        configs[case] = (home / str(i), write(home / str(i)))
    done = commands(2, [["train", configs[c][1], *flags_of(c)] for c in cases], env=REAL_MPI)
    return {c: (*configs[c], rc, err) for c, (rc, _out, err) in zip(cases, done)}


@pytest.mark.mpi
@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_each_refusal_is_trains_message(refused, cli, case):
    """The line `check --ranks 2` prints is the line `mpiexec -n 2 deepfusion train` prints,
    rank included; exit 2 both; nothing is written."""
    where, config, train_rc, train_err = refused[case]
    rc, out, err = cli(["check", config, "--ranks", "2", "--no-probe", *flags_of(case)])
    assert rc == 2 and out == "", (out, err)
    said = error_line(err)
    assert train_rc == 2, train_err[-2000:]
    assert said in train_err.splitlines(), (said, train_err[-2000:])
    if case == "a rank's block":
        assert said.startswith("deepfusion: error: (rank 1) parallel.domain = [1, 2]: this test")
    assert not (where / "run").exists()


def test_run_directory_states_as_train_judges_them(tmp_path, cli):
    """A run already there (without --resume / --overwrite), --resume of nothing, and the
    --resume and --overwrite that pass; the state is said."""
    config = write(tmp_path)
    run = tmp_path / "run"
    rc, _, err = cli(["check", config, "--ranks", "2", "--no-probe", "--resume", str(run)])
    assert rc == 2 and f"(rank 0) --resume {run}: no run there" in err
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    rc, _, err = cli(["check", config, "--ranks", "1", "--no-probe"])
    assert rc == 2 and f"deepfusion: error: run directory '{run}' already holds a run" in err
    rc, out, _ = cli(["check", config, "--ranks", "1", "--no-probe", "--overwrite"])
    assert rc == 0 and f"run directory {run}: replaced (--overwrite)" in out
    (run / "config.toml").write_text(open(config).read())
    # a run with no checkpoint to resume from: train --resume's refusal (one that passes:
    # tests/test_edge_messages.py)
    rc, _, err = cli(["check", "--resume", str(run), "--ranks", "4", "--no-probe"])
    assert rc == 2 and f"--resume {run}: no loadable checkpoint" in err


def test_a_live_lock_is_refused_and_a_stale_one_noted(tmp_path, cli):
    """The lock is looked at, never taken: a live holder (this process) is train's refusal;
    a dead one's lock is what train takes over, said as a note."""
    from deepfusion.engine.run import lock as runlock
    config = write(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    lock = run / runlock.LOCK_NAME
    live = runlock.Holder.here(ranks=2, command="deepfusion train")
    with subprocess.Popen(["sleep", "120"]) as job:  # another live process on this machine
        live.pid, live.pid_start = job.pid, runlock.process_start(job.pid)
        lock.write_bytes(live.encode())
        rc, _, err = cli(["check", config, "--ranks", "2", "--no-probe"])
        job.kill()
    assert rc == 2 and f"(rank 0) run directory '{run}' is in use by a live job: PID {job.pid}" in err
    dead = runlock.Holder.here(ranks=2, command="deepfusion train")
    dead.pid, dead.heartbeat = 2**22 + 12345, time.time()  # no such process on this machine
    lock.write_bytes(dead.encode())
    rc, _, err = cli(["check", config, "--ranks", "2", "--no-probe"])
    assert rc == 0 and "a stale lock, which train takes over" in err, err
    assert lock.read_bytes() == dead.encode()  # untouched


def test_no_probe_reports_the_layout_and_the_data_parallel_limit(tmp_path, cli):
    config = write(tmp_path, "train.levels=[{grid=[8,8],steps=5},{grid=[16,16],steps=5,global_batch=2}]",
                   "train.cycle='half-v'")
    js = tmp_path / "r.json"
    rc, out, err = cli(["check", config, "--ranks", "2", "--no-probe", "--json", str(js)])
    assert rc == 0, err
    assert "passed every start-up check of deepfusion train" in out and "probe:" not in out
    assert "level 1 (16x16): global batch 2 = 1 per unit, 5 step(s)" in out
    assert "largest useful rank count: 2" in out
    assert "train.levels[1] (grid [16, 16]): global batch 2 on 2 data-parallel unit(s) is 1" in err
    report = json.loads(js.read_text())
    assert "probe" not in report and report["data_limit"] == 2 and report["units"] == 2
    assert [lv["per_unit"] for lv in report["levels"]] == [2, 1]
    rc, _, err = cli(["check", config, "--ranks", "4", "--no-probe"])
    assert rc == 2 and "train.levels[0] (grid [8, 8]): data.global_batch = 4" not in err
    assert "(rank 0) train.levels[1] (grid [16, 16]): data.global_batch = 2 is not divisible" in err


def warning_lines(err: str) -> list[str]:
    return [x for x in err.splitlines() if "parallel.max_useful_ranks = " in x]


def test_past_the_useful_rank_count_is_a_warning_not_a_refusal(tmp_path, cli):
    """parallel.max_useful_ranks = 2 (a batch of 4 allows 4 ranks): 4 ranks pass with one
    warning saying what to do, 2 ranks say nothing; jobs render / sweep get the same line."""
    from deepfusion.jobs.precheck import check_job

    config = write(tmp_path, "parallel.max_useful_ranks=2")
    js = tmp_path / "r.json"
    rc, out, err = cli(["check", config, "--ranks", "4", "--no-probe", "--json", str(js)])
    assert rc == 0, err
    (line,) = warning_lines(err)
    assert line.startswith("deepfusion: warning: 4 ranks is past parallel.max_useful_ranks = 2")
    assert "Run on 2 ranks or fewer" in line and "parallel.domain" in line
    assert "largest useful rank count: 2 (parallel.max_useful_ranks); the batches allow up " \
           "to 4" in out
    assert json.loads(js.read_text())["max_useful_ranks"] == 2
    rc, out, err = cli(["check", config, "--ranks", "2", "--no-probe"])
    assert rc == 0 and warning_lines(err) == [], err
    render = check_job(config, [], 2, 2, 1, None)  # 2 nodes x 2 ranks
    assert [f"deepfusion: warning: {w}" for w in warning_lines("\n".join(render))] == [line]


def test_without_a_useful_rank_count_the_batches_limit_is_said(tmp_path, cli):
    """No parallel.max_useful_ranks: the data-parallel limit is the largest useful count, at
    it a warning (one sample per rank), past it train's refusal; a stated count past what the
    batches allow is said to be so."""
    config = write(tmp_path)
    rc, out, err = cli(["check", config, "--ranks", "4", "--no-probe"])
    assert rc == 0 and "largest useful rank count: 4 (4 data-parallel units" in out
    assert "is 1 sample each" in err and warning_lines(err) == []
    rc, _, err = cli(["check", config, "--ranks", "8", "--no-probe"])
    assert rc == 2 and "data.global_batch = 4 is not divisible" in err
    rc, out, _ = cli(["check", config, "--ranks", "2", "--no-probe",
                      "--set", "parallel.max_useful_ranks=16"])
    assert rc == 0 and "largest useful rank count: 4 (4 data-parallel units: every level's " \
                       "global batch splits evenly over them; parallel.max_useful_ranks = 16 " \
                       "is past what these batches allow)" in out


@pytest.mark.mpi
@pytest.mark.full
def test_train_warns_once_past_the_useful_rank_count(tmp_path, cli):
    """mpiexec -n 2 train with parallel.max_useful_ranks = 1: check's warning line, printed
    once (rank 0), and the run trains."""
    config = write(tmp_path, "parallel.max_useful_ranks=1", "train.max_steps=1",
                   "data.eval_samples=0")
    _, _, err = cli(["check", config, "--ranks", "2", "--no-probe"])
    (said,) = warning_lines(err)
    train = deepfusion(2, ["train", config], env=REAL_MPI)
    assert train.returncode == 0, train.stderr[-2000:]
    assert warning_lines(train.stderr) == [said], train.stderr[-2000:]


def test_the_probe_measures_each_level(tmp_path, cli):
    """Two levels (the second grows the network): per level, warm-up + N step times, the
    median after the warm-up, the peak memory of the rank, at one rank's share of the batch."""
    config = write(tmp_path, "train.levels=[{grid=[8,8],steps=5},"
                             "{grid=[16,16],steps=5,global_batch=2,prolong=true}]",
                   "train.cycle='half-v'")
    js = tmp_path / "r.json"
    rc, out, err = cli(["check", config, "--ranks", "2", "--threads", "1", "--probe-steps", "2",
                        "--json", str(js)])
    assert rc == 0, err
    assert "probe: 2 measured step(s) per level after 1 warm-up, one rank's share of the batch, " \
           "on this host (" in out and "1 thread(s) per rank" in out
    probe = json.loads(js.read_text())["probe"]
    assert (probe["steps"], probe["warmup"], probe["ranks"], probe["threads"]) == (2, 1, 1, 1)
    levels = probe["levels"]
    assert [(lv["level"], lv["grid"], lv["local_batch"]) for lv in levels] == \
        [(0, [8, 8], 2), (1, [16, 16], 1)]
    for lv in levels:
        assert len(lv["times"]) == 3 and lv["median_step_s"] > 0 and lv["peak_mib"] > 0
        assert lv["median_step_s"] == pytest.approx(statistics.median(lv["times"][1:]))
        assert f"level {lv['level']} ({'x'.join(map(str, lv['grid']))}): batch " in out
    assert not (tmp_path / "run").exists()  # the probe trains in a temporary directory


@pytest.mark.mpi
@pytest.mark.full
def test_the_probe_of_a_domain_split_runs_one_group(tmp_path, cli):
    """parallel.domain = [1, 2] on 4 ranks: 2 data-parallel units of 2 ranks; the probe runs one
    unit, 2 local ranks, at half the global batch."""
    config = write(tmp_path, "parallel.domain=[1,2]")
    js = tmp_path / "r.json"
    rc, out, err = cli(["check", config, "--ranks", "4", "--probe-steps", "1", "--json", str(js)])
    assert rc == 0, err
    assert "4 = 2 data-parallel unit(s) x 2 ranks per sample (parallel.domain)" in out
    probe = json.loads(js.read_text())["probe"]
    assert probe["ranks"] == 2 and probe["levels"][0]["local_batch"] == 2
    assert "(2 ranks, run here as 2 local processes)" in out


@pytest.mark.full
def test_a_failing_probe_is_exit_1_with_its_last_lines(tmp_path, cli):
    """The checks pass (exit 0 with --no-probe); the probe's step fails: exit 1, its last
    lines shown, and the report says so."""
    config = write(tmp_path, f'problem.name="{__name__}:LossFails"')
    rc, _, err = cli(["check", config, "--ranks", "1", "--no-probe"])
    assert rc == 0, err
    js = tmp_path / "r.json"
    rc, out, err = cli(["check", config, "--ranks", "1", "--probe-steps", "1", "--json", str(js)])
    assert rc == 1 and "passed every start-up check" in out
    assert "deepfusion: error: the probe failed (exit 1):" in err
    assert "this test problem's loss fails at the first step" in err
    assert "the probe failed" in json.loads(js.read_text())["probe"]["error"]
    rc, _, err = cli(["check", config, "--ranks", "1", "--probe-steps", "0"])
    assert rc == 2 and "--probe-steps must be >= 1" in err
