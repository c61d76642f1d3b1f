"""lab.tools.batch_study on a tiny plan: arms, a run split into two segments, the report."""
import json
import os

import pytest

from lab.tools import batch_study

BASE = """
[problem]
name = "poisson"
grid = [16, 16]
[model]
name = "unet"
options = { depth = 2, base_width = 4 }
[data]
n_samples = 16
global_batch = 4
eval_samples = 2
[train]
epochs = 4
checkpoint_every = 2
[run]
dir = "unused"
progress = "log"
"""


def plan(tmp_path) -> str:
    (tmp_path / "base.toml").write_text(BASE)
    text = f"""
batches = [16, 64]
rules = ["sqrt", "linear", "lbfgs"]
lbfgs_min_batch = 64
micro_batch = 16
eval_every_samples = 64
test_draws = 2
runs_dir = "{tmp_path / 'runs'}"
[family.tiny]
base = "{tmp_path / 'base.toml'}"
lr = 1e-3
warmup_steps = 2
samples = 256
target = 10.0
"""
    (tmp_path / "plan.toml").write_text(text)
    return str(tmp_path / "plan.toml")


def test_arms_scale_the_learning_rate_and_skip_duplicates(tmp_path):
    arms = {a["name"]: a for a in batch_study.arms(batch_study.load_plan(plan(tmp_path)))}
    assert sorted(arms) == ["tiny_b16_sqrt", "tiny_b64_lbfgs", "tiny_b64_linear", "tiny_b64_sqrt"]
    sets = {n: dict(s.split("=", 1) for s in a["sets"]) for n, a in arms.items()}
    assert sets["tiny_b64_sqrt"]["optim.lr"] == "0.002"          # sqrt(64 / 16) = 2
    assert sets["tiny_b64_linear"]["optim.lr"] == "0.004"        # 64 / 16 = 4
    assert sets["tiny_b16_sqrt"]["train.max_steps"] == "16"      # 256 samples / 16
    assert sets["tiny_b64_lbfgs"]["train.max_steps"] == "2"      # half: line-search evaluations
    assert sets["tiny_b64_sqrt"]["data.n_samples"] == "64"       # the pool grows to the batch


def test_lamb_and_longer_arms(tmp_path):
    path = plan(tmp_path)
    with open(path, "a") as f:
        f.write('lamb_lr = 0.02\n[longer]\nfactor = 2\narms = ["tiny_b64_linear"]\n')
    text = open(path).read().replace('"linear", "lbfgs"]', '"linear", "lamb", "lbfgs"]')
    open(path, "w").write(text.replace("lbfgs_min_batch = 64", "lbfgs_min_batch = 64\n"
                                       "lamb_min_batch = 64"))
    arms = {a["name"]: a for a in batch_study.arms(batch_study.load_plan(path))}
    assert {"tiny_b64_lamb", "tiny_b64_linear_x2"} <= set(arms) and "tiny_b16_lamb" not in arms
    sets = {n: dict(s.split("=", 1) for s in a["sets"]) for n, a in arms.items()}
    assert sets["tiny_b64_lamb"]["optim.name"] == '"lamb"'
    assert sets["tiny_b64_lamb"]["optim.lr"] == "0.04"            # lamb_lr * sqrt(64 / 16)
    assert sets["tiny_b64_linear_x2"]["train.max_steps"] == "8"   # twice 256 samples / 64
    assert sets["tiny_b64_linear_x2"]["optim.lr"] == sets["tiny_b64_linear"]["optim.lr"]
    assert arms["tiny_b64_linear_x2"]["budget"] == 2


def test_adam_then_lbfgs_arms_switch_at_half_the_samples(tmp_path):
    path = plan(tmp_path)
    text = open(path).read().replace('"linear", "lbfgs"]', '"linear", "lbfgs", "adam_lbfgs"]')
    open(path, "w").write(text)
    arms = {a["name"]: a for a in batch_study.arms(batch_study.load_plan(path))}
    assert "tiny_b64_adam_lbfgs" in arms and "tiny_b16_adam_lbfgs" not in arms
    sets = dict(s.split("=", 1) for s in arms["tiny_b64_adam_lbfgs"]["sets"])
    # 256 samples at 64: 2 Adam steps (128 samples), then 1 L-BFGS step of two evaluations
    assert sets["train.max_steps"] == "3" and sets["optim.switch_to_lbfgs_epoch"] == "2"
    assert sets["optim.name"] == '"adam"' and sets["optim.lr"] == "0.004"


@pytest.mark.mpi
def test_run_resumes_segments_and_reports_steps_to_target(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = plan(tmp_path)
    arm = next(a for a in batch_study.arms(batch_study.load_plan(p))
               if a["name"] == "tiny_b64_sqrt")
    assert batch_study.train_segment(arm, 1, 1e-6) == 99          # stopped at its time limit
    assert batch_study.state(arm) == "started"
    assert batch_study.main(["run", p, "--ranks", "1", "--only", "tiny_b64_sqrt"]) == 0
    assert batch_study.main(["report", p, "--out", str(tmp_path / "r.json")]) == 0
    rows = {r["name"]: r for r in json.loads((tmp_path / "r.json").read_text())["arms"]}
    row = rows["tiny_b64_sqrt"]
    assert row["state"] == "done" and row["last_step"] == 4
    assert row["steps_to_target"] >= 1 and row["samples_to_target"] == 64 * row["steps_to_target"]
    assert row["test"]["n"] == 2 and row["test"]["step"] == 4
    assert rows["tiny_b16_sqrt"]["state"] == "new" and rows["tiny_b16_sqrt"]["test"] is None
    log = (tmp_path / "runs" / "tiny_b64_sqrt.log").read_text()
    assert log.count("$ ") == 2 and "--resume" in log                # two segments


def test_a_failed_arm_is_recorded_skipped_and_reported(tmp_path):
    """An arm whose training exits with an error (here: an option the problem does not have)
    is marked failed with the reason, not retried by run, and reported as such."""
    path = plan(tmp_path)
    text = open(path).read().replace(f'base = "{tmp_path / "base.toml"}"',
                                     f'base = "{tmp_path / "bad.toml"}"')
    open(path, "w").write(text)
    (tmp_path / "bad.toml").write_text(BASE.replace('name = "poisson"',
                                                    'name = "poisson"\noptions = { n_term = 4 }'))
    p = batch_study.load_plan(path)
    arm = next(a for a in batch_study.arms(p) if a["name"] == "tiny_b16_sqrt")
    assert batch_study.train_segment(arm, 1, 5.0) == 2
    assert batch_study.state(arm) == "failed"
    assert "n_term" in open(os.path.join(arm["run_dir"], "study_failed")).read()
    row = next(r for r in batch_study.report(p, {})["arms"] if r["name"] == "tiny_b16_sqrt")
    assert row["state"] == "failed" and "n_term" in row["failure"]
    assert batch_study.run(p, 1, 5.0, ["tiny_b16_sqrt"]) == 0            # skipped, not retried
    assert open(arm["run_dir"] + ".log").read().count("$ ") == 1
