"""``train.coarse_to_fine = K``: a multigrid schedule from one setting, written into
``train.levels`` when the config is resolved. The expansion (grids halved, steps split 2:1,
prolonged finer levels at half the rate), the resolved config read back, the refusals naming
the fix, the same losses bit for bit as the levels written by hand, and a plugin's problem
(examples/families, "adr:ADR") trained through it."""
from __future__ import annotations

import json
import os
import sys

import pytest

from deepfusion.config import ConfigError, dump_toml, load_config
from deepfusion.config.plans import coarse_to_fine_grids, split_steps
from deepfusion.engine.train.plan import plan
from tests.in_process import deepfusion_here
from tests.mpi_util import ROOT
from tests.tiny_configs import TINY, variant

FAMILIES = os.path.join(ROOT, "examples", "families")

# 16x16 Burgers, 3 epochs of 4 steps: 8 steps on 8x8, then 4 on 16x16 grown from it
C2F = variant(TINY, "train.epochs=3", "train.coarse_to_fine=2", 'optim.schedule="cosine"',
              "optim.warmup_steps=2", "optim.min_lr=1e-4", "train.log_every=1")


def write(tmp_path, text, name="c.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [(r["step"], r["grid"], r["loss"], r["lr"]) for r in map(json.loads, f)
                if r["kind"] == "step"]


# -- the expansion -------------------------------------------------------------------------------

def test_grids_halve_even_node_counts_and_nest_odd_ones():
    assert coarse_to_fine_grids([256, 128], 3) == [[64, 32], [128, 64], [256, 128]]
    assert coarse_to_fine_grids([65, 65], 3) == [[17, 17], [33, 33], [65, 65]]
    assert coarse_to_fine_grids([32, 32, 32], 2) == [[16, 16, 16], [32, 32, 32]]


def test_steps_split_two_to_one_and_add_up():
    assert split_steps(700, 3) == [400, 200, 100]
    assert split_steps(640, 2) == [426, 214]
    assert all(sum(split_steps(n, k)) == n for n in (7, 100, 2048) for k in (2, 3))


def test_the_levels_it_writes(tmp_path):
    cfg = load_config(write(tmp_path, variant(C2F, "problem.grid=[64, 64]", "train.epochs=7",
                                              "train.coarse_to_fine=3")))
    assert cfg.train.levels == [
        {"grid": [16, 16], "steps": 16},
        {"grid": [32, 32], "steps": 8, "prolong": True,
         "optim": {"lr": 1.5e-3, "warmup_steps": 0}},
        {"grid": [64, 64], "steps": 4, "prolong": True,
         "optim": {"lr": 7.5e-4, "warmup_steps": 0}}]
    v = plan(cfg)
    assert [(x.grid, x.steps, x.grows, x.optim.lr) for x in v] == [
        ((16, 16), 16, False, 3e-3), ((32, 32), 8, True, 1.5e-3), ((64, 64), 4, True, 7.5e-4)]
    # optim.min_lr above a level's rate is capped at it
    low = load_config(write(tmp_path, variant(C2F, "optim.min_lr=2e-3")))
    assert low.train.levels[1]["optim"] == {"lr": 1.5e-3, "warmup_steps": 0, "min_lr": 1.5e-3}


def test_the_resolved_config_reads_back_and_config_prints_the_levels(tmp_path):
    path = write(tmp_path, C2F)
    cfg = load_config(path)
    again = load_config(write(tmp_path, dump_toml(cfg), "resolved.toml"))
    assert again.train.levels == cfg.train.levels and again.train.coarse_to_fine == 2
    p = deepfusion_here(["config", path])
    assert p.returncode == 0, p.stderr
    assert "levels = [{grid = [8, 8], steps = 8}, {grid = [16, 16], steps = 4, prolong = " \
           "true, optim = {lr = 0.0015, warmup_steps = 0}}]" in p.stdout


@pytest.mark.parametrize("sets,needle", [
    (["train.levels=[{grid = [8, 8], steps = 5}, {grid = [16, 16], steps = 7}]"],
     "Drop train.levels to train the one-setting plan"),
    (['train.cycle="v"'], 'set train.cycle = "half-v"'),
    (["train.coarse_to_fine=4"], "use at most 3 levels on this grid"),
    (["train.epochs=1", "data.n_samples=4", "train.coarse_to_fine=3"],
     "needs at least 7: raise train.epochs"),
    (['train.time_budget="10m"'], "give the levels' lengths in steps or epochs, or drop "
                                  "train.coarse_to_fine"),
])
def test_conflicts_are_refused_naming_the_fix(tmp_path, sets, needle):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, C2F), sets)
    assert needle in str(e.value)


def test_a_resolved_config_with_another_length_is_refused(tmp_path):
    """A run directory's config.toml records the levels; another train.epochs over it would
    re-split them: refused, saying how to plan anew or keep the levels."""
    resolved = write(tmp_path, dump_toml(load_config(write(tmp_path, C2F))), "resolved.toml")
    with pytest.raises(ConfigError) as e:
        load_config(resolved, ["train.epochs=6"])
    assert "remove them from it to plan anew" in str(e.value)
    assert "train.coarse_to_fine = 0 to train the levels as listed" in str(e.value)


def test_a_grid_the_network_cannot_take_names_the_setting(tmp_path):
    p = deepfusion_here(["check", write(tmp_path, variant(C2F, "train.coarse_to_fine=3")),
                         "--ranks", "1", "--no-probe"])
    assert p.returncode == 2
    assert "train.levels[0].grid = [4, 4]" in p.stderr
    assert "train.coarse_to_fine = 3 wrote this level" in p.stderr


# -- training --------------------------------------------------------------------------------------

def test_same_losses_bit_for_bit_as_the_levels_written_by_hand(tmp_path):
    by_hand = variant(C2F, "train.coarse_to_fine=0",
                      "train.levels=[{grid = [8, 8], steps = 8}, {grid = [16, 16], steps = 4, "
                      "prolong = true, optim = {lr = 1.5e-3, warmup_steps = 0}}]")
    runs = {}
    for name, text in (("one", C2F), ("hand", by_hand)):
        d = str(tmp_path / name)
        p = deepfusion_here(["train", write(tmp_path, text, f"{name}.toml"), "--set",
                             f"run.dir={d}"])
        assert p.returncode == 0, p.stderr
        runs[name] = losses(d)
    assert len(runs["one"]) == 12 and {tuple(r[1]) for r in runs["one"]} == {(8, 8), (16, 16)}
    assert runs["one"] == runs["hand"]


def test_a_plugin_trains_through_it(tmp_path, monkeypatch):
    """The ADR family of examples/families (a plugin: PYTHONPATH=examples/families, problem
    "adr:ADR") through two levels: the network grown on the finer one."""
    monkeypatch.syspath_prepend(FAMILIES)
    monkeypatch.delitem(sys.modules, "adr", raising=False)
    d = str(tmp_path / "adr")
    p = deepfusion_here(["train", os.path.join(FAMILIES, "adr.toml"),
                         "--set", f"run.dir={d}", "--set", "problem.grid=[16, 16]",
                         "--set", "model.options={depth = 1, base_width = 4}",
                         "--set", "data.n_samples=8", "--set", "data.global_batch=4",
                         "--set", "data.eval_samples=2", "--set", "train.epochs=2",
                         "--set", "optim.warmup_steps=0", "--set", "train.coarse_to_fine=2",
                         "--set", "train.log_every=1", "--set", "parallel.threads_per_rank=1"])
    assert p.returncode == 0, p.stderr
    steps = losses(d)
    assert [(s, tuple(g)) for s, g, *_ in steps] == [(1, (8, 8)), (2, (8, 8)), (3, (16, 16)),
                                                    (4, (16, 16))]
    assert "prolonging the network from 8x8" in p.stdout
    with open(os.path.join(d, "eval.json")) as f:
        assert json.load(f)["grid"] == [16, 16]
