"""The gradient all-reduce accounted per rank (deepfusion/engine/parallel/commstats.py): waiting
for the other ranks told apart from moving the bytes, in every step record of a P = 2 run.

A rank made late to the all-reduce (``slow@3:1``: rank 1 sleeps after its backward pass,
tests/faults/steps.py) must show up as the other rank's wait, by the difference of the ranks'
arrivals (how long after the previous loss reduction each entered), within half the sleep; the
accounting changes no number of the training. Relations only, no time asserted on its own.
"""
import json
import os

import pytest

from deepfusion.engine.checkpoint import store as ckpt
from deepfusion.engine.parallel import commstats
from deepfusion.jobs import project
from tests.faults.steps import SLOW_S, fault_env
from tests.mpi_util import REAL_MPI, commands
from tests.tiny_configs import TINY, variant

LISTS = ("allreduce_enter_s", "allreduce_wait_s", "allreduce_move_s", "allreduce_exposed_s",
         "allreduce_progress_s", "allreduce_arrive_s")
SLOW_STEP = 3


def steps(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == "step"]


def gradient_bytes(run_dir):
    """Bytes of the gradient: one Adam moment per trained parameter, as large as its gradient."""
    _, state, _ = ckpt.load_latest(run_dir)
    return sum(s["exp_avg"].numel() * s["exp_avg"].element_size()
               for s in state["optim_state"]["state"].values())


@pytest.mark.mpi
def test_a_late_rank_is_waited_for_by_the_other_and_nothing_numerical_changes(tmp_path):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(variant(TINY, "train.max_steps=5", "data.eval_samples=0"))
    runs = {k: str(tmp_path / k) for k in ("plain", "overlap", "off")}
    sets = {"plain": [], "overlap": ["parallel.overlap=true", "parallel.bucket_mb=0.01"],
            "off": ["parallel.allreduce_stats=\"off\""]}
    argvs = [["train", str(cfg), "--set", f"run.dir={d}",
              *[a for s in sets[k] for a in ("--set", s)]] for k, d in runs.items()]
    done = commands(2, argvs, env={**REAL_MPI, **fault_env(f"slow@{SLOW_STEP}:1")})
    assert [code for code, _, _ in done] == [0, 0, 0], [err[-2000:] for _, _, err in done]

    nbytes = gradient_bytes(runs["plain"])
    for k in ("plain", "overlap"):
        recs = steps(runs[k])
        assert len(recs) == 5
        for r in recs:
            assert r["allreduce_overlap"] == (k == "overlap")
            assert r["allreduce_bytes"] == nbytes
            assert all(len(r[f]) == 2 and min(r[f]) >= 0 for f in LISTS), r
            for rank in (0, 1):
                wait, move = r["allreduce_wait_s"][rank], r["allreduce_move_s"][rank]
                assert wait + move <= r["allreduce_exposed_s"][rank] + 2e-6, r
            assert r["allreduce_exposed_s"][0] <= r["time_step"], r   # rank 0's own step
            if k == "plain":
                assert r["allreduce_progress_s"] == [0.0, 0.0]  # no hooks without overlap
            assert min(r["allreduce_wait_s"]) == 0.0  # the last to arrive waited for nobody
        for r in recs[1:]:  # since the previous loss reduction: the end of backward is in it
            assert all(a >= e for a, e in zip(r["allreduce_arrive_s"], r["allreduce_enter_s"]))
        late = recs[SLOW_STEP - 1]
        assert late["allreduce_enter_s"][1] >= SLOW_S          # rank 1 slept before entering
        wait0, wait1 = late["allreduce_wait_s"]
        arrive0, arrive1 = late["allreduce_arrive_s"]
        # The ranks left the previous step's loss reduction together, so rank 0 waits for rank 1
        # by the difference of their arrivals (the sleep, less however long a loaded host held
        # rank 0 up too, wherever in its step). Without overlap it waits in the gradient's
        # all-reduce; with overlap the buckets may have been summed during the backward passes
        # already, and then it waits in the step's loss reduction instead: in its reductions
        # either way.
        skew = arrive1 - arrive0
        if k == "plain":
            assert abs((wait0 - wait1) - skew) < SLOW_S / 2, late
        assert late["time_allreduce"] > skew - SLOW_S / 2, (k, late)
        assert min(wait0, wait1) == 0.0 and late["allreduce_exposed_s"][0] >= wait0
        assert late["time_step"] >= wait0

    off = steps(runs["off"])
    assert not any(k.startswith("allreduce_") for r in off for k in r)
    # The durations ride in the loss all-reduce and change no number: the same losses, bit for
    # bit, with the accounting on (and a rank made late) or off.
    assert [r["loss"] for r in off] == [r["loss"] for r in steps(runs["plain"])]
    assert [r["grad_norm"] for r in off] == [r["grad_norm"] for r in steps(runs["plain"])]

    # jobs project takes the overlap from the two runs (one with, one without) and the skew
    study = tmp_path / "study.json"
    study.write_text(json.dumps({"arms": [{"family": "f", "batch": 16, "rule": "sqrt",
                                           "steps_to_target": 100}]}))
    assert project.main(["--study", str(study), "--family", "f", "--t-sample", "0.01",
                         "--grid", "64x64", "--nodes", "1,4", "--overlap", "--measured",
                         runs["plain"], "--measured", runs["overlap"],
                         "--out", str(tmp_path / "project")]) == 0
    doc = json.loads((tmp_path / "project" / "project.json").read_text())
    m = doc["inputs"]["allreduce_model"]
    assert m["overlap_from"].startswith("measured") and m["hidden_share"] >= 0
    assert m["skew_share"] >= 0 and "2 ranks, with overlap" in m["skew_from"]


def test_wait_is_the_first_calls_excess_over_the_last_arrival():
    """Rank 0 blocked 0.5 s longer in the first call than rank 1: that is its wait; the rest of
    its time inside is moving; L-BFGS's several reductions of one step add up per rank."""
    rows = [[0.001, 0.52, 0.55, 0.0, 0.1], [0.5, 0.02, 0.06, 0.0, 0.6]]  # commstats.FIELDS
    rec = commstats.attribute(rows, nbytes=800, overlap=False)
    assert rec["allreduce_wait_s"] == [0.5, 0.0] and rec["allreduce_arrive_s"] == [0.1, 0.6]
    assert rec["allreduce_move_s"] == pytest.approx([0.05, 0.06])
    assert rec["allreduce_exposed_s"] == pytest.approx([0.551, 0.56])
    both = commstats.combine([rec, {}, rec])
    assert both["allreduce_bytes"] == 1600 and both["allreduce_wait_s"] == [1.0, 0.0]
    assert commstats.combine([{}, {}]) == {}


@pytest.mark.parametrize("setting,ranks,on", [
    ("auto", 1, False), ("auto", 2, True), ("auto", 16, True), ("auto", 17, False),
    ("on", 64, True), ("on", 1, False), ("off", 2, False)])
def test_allreduce_stats_option(setting, ranks, on):
    from deepfusion.config import ParallelConfig

    assert ParallelConfig(allreduce_stats=setting).allreduce_stats_on(ranks) is on
