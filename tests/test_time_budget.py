"""``train.time_budget`` and the re-planned schedule: the budget read from its text, the count
decided from the measured step time (the slowest rank's, on every rank alike), then checked
three times from the wall time per step (a quarter, half and three quarters of the way), the
schedule held until the first decision and run to the decided end, the decisions recorded and kept by a resume, and decided
again when the budget or train.max_steps changes. Step times are fixed through the
test hook (tests/budget_clock.py): nothing here depends on how fast the machine is."""
from __future__ import annotations

import json
import math
import os

import pytest

from deepfusion.config import ConfigError, load_config
from deepfusion.config.plans import budget_seconds
from deepfusion.engine.checkpoint.store import load_checkpoint
from deepfusion.engine.train.budget import (CHECK_RESERVE, CHECKS, MEASURE, RESERVE, SKIP,
                                            TimeBudget, decide)
from deepfusion.engine.train.schedule import Schedule
from deepfusion.engine.train.stepper import lr_at
from tests.budget_clock import clock_env
from tests.in_process import deepfusion_here
from tests.mpi_util import deepfusion
from tests.tiny_configs import TINY, variant

# 16x16 Burgers with a cosine; the budget makes its length: 10 steps timed, then the decision
BUDGET = variant(TINY, 'optim.schedule="cosine"', "optim.min_lr=1e-5", 'train.time_budget="60s"',
                 "train.log_every=1", "train.checkpoint_every=12", "train.keep_checkpoints=10")
DECIDE_AT = SKIP + MEASURE


def records(run_dir, kind):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def expected_steps(budget, step_s, at, elapsed, check=False):
    return at + int((budget - elapsed) * (1 - (CHECK_RESERVE if check else RESERVE)) // step_s)


def check_step(at, steps, check=0):
    """The step of the check after a decision (check ``check``) at ``at`` for ``steps``."""
    return at + max(MEASURE, (steps - at) // (CHECKS + 1 - check))


def expected_decisions(budget, step_s, elapsed_at, first_at=DECIDE_AT):
    """[(at_step, steps, check)] of a run whose steps take ``step_s`` on its slowest rank and
    whose rank 0 reads ``elapsed_at(step)`` seconds at a step: the first decision, then each
    check the run reaches before its end."""
    steps = expected_steps(budget, step_s, first_at, elapsed_at(first_at))
    out, at = [(first_at, steps, 0)], first_at
    for k in range(1, CHECKS + 1):
        c = check_step(at, steps, k - 1)
        if c > steps:
            break
        steps = expected_steps(budget, step_s, c, elapsed_at(c), check=True)
        out.append((c, steps, k))
        at = c
    return out


# -- pieces ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,seconds", [("900", 900), ("15m", 900), ("1.5h", 5400),
                                          ("1h30m", 5400), ("1h 30m 10s", 5410), ("0.5", 0.5)])
def test_budget_text(text, seconds):
    assert budget_seconds(text) == seconds


@pytest.mark.parametrize("text", ["15 minutes", "m", "-5", "0", "1h30x", "inf"])
def test_unreadable_budget_is_refused_naming_the_forms(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(TINY)
    with pytest.raises(ConfigError) as e:
        load_config(str(path), [f'train.time_budget="{text}"'])
    assert e.value.key == "train.time_budget"


def test_a_number_is_seconds_and_levels_are_refused(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(TINY)
    assert load_config(str(path), ["train.time_budget=900"]).train.budget_seconds() == 900
    with pytest.raises(ConfigError) as e:
        load_config(str(path), ["train.time_budget=900", "problem.grid=[32, 32]",
                                "train.levels=[{grid = [16, 16], steps = 2}, "
                                "{grid = [32, 32], steps = 2}]"])
    assert "give the levels' lengths in steps or epochs, or drop train.levels" in str(e.value)


def test_the_count_fills_the_time_left_less_the_reserve():
    d = decide(100.0, 0, 2.0, 10, 20.0)
    assert d.steps == 10 + int(80 * (1 - RESERVE) // 2.0)
    assert decide(100.0, 0, 2.0, 10, 150.0).steps == 10  # spent: the run ends where it is
    assert decide(100.0, 30, 2.0, 10, 20.0).steps == 30  # train.max_steps caps it


def test_the_measured_time_skips_the_first_steps_and_is_a_median():
    now = iter([0.0, 50.0, 51.0] + [51.0 + s for s in (1, 2, 3, 13, 14, 15, 16, 17)])
    b = TimeBudget(100.0, 0, clock=lambda: next(now))  # t0 = 0: step 1 takes 50 s
    due = [b.tick(step) for step in range(1, DECIDE_AT + 1)]
    assert due == [None] * (DECIDE_AT - 1) + ["decide"]
    assert b.step_seconds() == 1.0  # steps 3..10: 1 1 1 10 1 1 1 1, the median; 50 s not seen


def test_schedule_warp_continues_the_rate_and_ends_at_the_new_end():
    cfg = load_config(None, ['problem.name="burgers"', "optim.lr=1.0", "optim.min_lr=0.0"]).optim
    s = Schedule(100)
    assert s.at(37) == 37 and isinstance(s.at(37), int)  # unchanged: the step itself
    r = s.replan(40, 200, 0)
    assert r.length == 100 and r.warp == (40, 40.0, 200)
    assert lr_at(r.at(40), r.length, cfg) == lr_at(40, 100, cfg)
    assert lr_at(r.at(199), r.length, cfg) == pytest.approx(lr_at(99, 100, cfg), abs=1e-3)
    assert lr_at(r.at(200), r.length, cfg) == 0.0
    twice = r.replan(120, 150, 0)  # re-planned again: from where the first warp stood
    assert twice.warp == (120, r.at(120), 150) and twice.length == 100
    assert s.replan(40, 100, 0) == Schedule(100)  # the same end: no warp
    held = Schedule(0)
    assert held.progress(5) == 0.0 and lr_at(held.at(5), 0, cfg) == 1.0
    assert held.replan(10, 50, 3) == Schedule(50, (10, 3.0, 50))  # from the schedule's start
    assert held.replan(2, 50, 3) == Schedule(50)                  # still warming up


# -- runs ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def budget_run(tmp_path_factory):
    """Two ranks whose steps take 0.5 s and 2 s on the budget's clock (run once)."""
    tmp = tmp_path_factory.mktemp("budget")
    (tmp / "b.toml").write_text(BUDGET)
    d = str(tmp / "run")
    p = deepfusion(2, ["train", str(tmp / "b.toml"), "--set", f"run.dir={d}"],
                   env=clock_env("0.5,2"))
    assert p.returncode == 0, p.stderr[-3000:]
    return str(tmp / "b.toml"), d, p


@pytest.mark.mpi
def test_two_ranks_decide_alike_from_the_slowest_rank(budget_run):
    """Each rank sees its own step time; the decision takes rank 1's 2 s, rank 0's clock
    (5 s after 10 steps of 0.5 s) and is broadcast: both ranks stop at the same step."""
    _, d, p = budget_run
    recs = records(d, "time_budget")
    want = expected_decisions(60.0, 2.0, lambda step: step * 0.5)
    assert [(r["at_step"], r["steps"], r["check"]) for r in recs] == want
    assert len(want) == CHECKS + 1 and recs[-1]["final"] and not recs[-2]["final"]
    assert recs[0]["elapsed_s"] == 5.0 and {r["step_s"] for r in recs} == {2.0}
    n = want[-1][1]
    steps = records(d, "step")
    assert [r["step"] for r in steps] == list(range(1, n + 1))
    for _, count, _ in want:       # each decision said once
        assert p.stdout.count(f"-> {count} steps") >= 1
    state = load_checkpoint(os.path.join(d, "checkpoints", f"step_{n:08d}.h5"))
    assert state["meta"]["time_budget"]["steps"] == n


@pytest.mark.mpi
def test_the_schedule_holds_until_decided_then_runs_to_the_end(budget_run):
    _, d, _ = budget_run
    lr = [r["lr"] for r in records(d, "step")]
    assert lr[:DECIDE_AT] == [3e-3] * DECIDE_AT  # held at its peak while measuring
    recs = records(d, "time_budget")
    first, c = recs[0]["steps"], recs[1]["at_step"]
    v = [(s - DECIDE_AT) * first / (first - DECIDE_AT) for s in range(DECIDE_AT, c + 2)]
    cosine = [1e-5 + 0.5 * (3e-3 - 1e-5) * (1 + math.cos(math.pi * x / first)) for x in v]
    assert lr[DECIDE_AT:c + 1] == pytest.approx(cosine[:-1])  # the first decision's plan
    tail = lr[c:]            # then from where it stood to each later decision's end
    assert all(a >= b for a, b in zip(tail, tail[1:])) and tail[-1] < 2e-5
    assert cosine[-1] < tail[1] < tail[0]  # no jump: slower than the first plan's next step


def run_here(args, seconds="1"):
    with pytest.MonkeyPatch.context() as mp:
        for k, v in clock_env(seconds).items():
            mp.setenv(k, v)
        return deepfusion_here(args)


def test_a_resume_keeps_the_decided_count_bit_for_bit(tmp_path):
    (tmp_path / "b.toml").write_text(BUDGET)
    full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
    for d in (full, cut):
        p = run_here(["train", str(tmp_path / "b.toml"), "--set", f"run.dir={d}"])
        assert p.returncode == 0, p.stderr
    recs = records(full, "time_budget")
    assert [(r["at_step"], r["steps"], r["check"]) for r in recs] == \
        expected_decisions(60.0, 1.0, lambda step: step)
    n, last = recs[-1]["steps"], recs[-1]["at_step"]
    assert n > recs[0]["steps"]  # the smaller reserve: the wall time counts the rest
    after = 12 * (last // 12 + 1)  # the first checkpoint after the last check
    for name in os.listdir(os.path.join(cut, "checkpoints")):
        if name != f"step_{after:08d}.h5":
            os.remove(os.path.join(cut, "checkpoints", name))
    p = run_here(["train", "--resume", cut])
    assert p.returncode == 0, p.stderr
    assert "re-planned" not in p.stdout
    assert [{k: v for k, v in r.items() if k != "run"} for r in records(cut, "time_budget")] \
        == [{k: v for k, v in r.items() if k != "run"} for r in recs]
    strip = ("run", "time_step", "samples_per_s", "elapsed_s", "segment_s", "eta_s",
             "eta_scaled", "time_data", "time_optimizer", "time_forward", "time_backward",
             "time_allreduce")
    a, b = ([{k: v for k, v in r.items() if not k.startswith(strip)} for r in records(x, "step")]
            for x in (full, cut))
    assert len(a) == n and a == b


def test_another_budget_or_cap_on_resume_decides_again_and_replans(tmp_path):
    (tmp_path / "b.toml").write_text(BUDGET)
    d = str(tmp_path / "run")
    p = run_here(["train", str(tmp_path / "b.toml"), "--set", f"run.dir={d}"])
    assert p.returncode == 0, p.stderr
    before = records(d, "step")
    for name in os.listdir(os.path.join(d, "checkpoints")):
        if name != "step_00000012.h5":
            os.remove(os.path.join(d, "checkpoints", name))
    p = run_here(["train", "--resume", d, "--set", 'train.time_budget="90s"'])
    assert p.returncode == 0, p.stderr
    first, again, *checks = records(d, "time_budget")
    assert first["at_step"] == DECIDE_AT and first["check"] == 0
    assert again["at_step"] == 12 and again["step_s"] == 1.0 and again["check"] == 0
    assert again["steps"] == expected_steps(90.0, 1.0, 12, again["elapsed_s"])
    assert "train.time_budget 60 s -> 90 s: decided again" in p.stdout
    assert "is re-planned to end after" in p.stdout
    # then checked in this process, as a new run is
    before_check = again
    for k, c in enumerate(checks, 1):
        assert c["check"] == k and c["step_s"] == 1.0
        assert c["at_step"] == check_step(before_check["at_step"], before_check["steps"], k - 1)
        assert c["steps"] == expected_steps(90.0, 1.0, c["at_step"], c["elapsed_s"], check=True)
        before_check = c
    assert checks and checks[-1]["final"]
    after = records(d, "step")
    assert len(after) == checks[-1]["steps"]
    again = checks[-1]
    assert after[12]["lr"] == pytest.approx(before[12]["lr"], rel=1e-12)  # continues, no jump
    assert after[-1]["lr"] == pytest.approx(1e-5, rel=0.2)  # its last step: about min_lr
    p = run_here(["train", "--resume", d, "--set", 'train.time_budget="90s"',
                  "--set", f"train.max_steps={again['steps'] + 3}"])
    assert p.returncode == 0, p.stderr  # the finished run given 3 more steps by the cap
    assert records(d, "time_budget")[-1]["steps"] == again["steps"] + 3
    assert "the learning-rate schedule had ended" in p.stdout  # its end rate continues
    assert [r["lr"] for r in records(d, "step")][-3:] == pytest.approx([1e-5] * 3)


def test_a_resume_before_the_decision_decides_in_its_own_process(tmp_path):
    (tmp_path / "b.toml").write_text(variant(BUDGET, "train.checkpoint_every=4",
                                              "train.keep_checkpoints=100"))
    d = str(tmp_path / "run")
    p = run_here(["train", str(tmp_path / "b.toml"), "--set", f"run.dir={d}"])
    assert p.returncode == 0, p.stderr
    for name in os.listdir(os.path.join(d, "checkpoints")):
        if name != "step_00000004.h5":
            os.remove(os.path.join(d, "checkpoints", name))
    p = run_here(["train", "--resume", d])
    assert p.returncode == 0, p.stderr
    rec, first_check, *_ = records(d, "time_budget")
    assert rec["at_step"] == 4 + DECIDE_AT
    assert first_check["at_step"] == check_step(4 + DECIDE_AT, rec["steps"])
    assert [r["lr"] for r in records(d, "step")][:4 + DECIDE_AT] == [3e-3] * (4 + DECIDE_AT)


@pytest.mark.mpi
def test_status_counts_against_the_decided_steps(budget_run):
    _, d, _ = budget_run
    n = records(d, "time_budget")[-1]["steps"]   # the final decision's
    p = deepfusion_here(["status", d, "--json"])
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["total_steps"] == n and report["state"] == "finished"
