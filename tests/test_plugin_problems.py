"""A user's own PDE without touching diffnet or deepfusion: ``problem.name`` as
``"package.module:ClassName"`` or as a plugin's entry point (group ``diffnet.problems``).

The plugins are tests/plugins/heat.py (the example family of examples/heat.py, and the same
family without a reference solver) and tests/plugins/broken.py (a module whose import fails).
Nothing here leaves a problem registered: other test files see the built-in registry only.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import diffnet.problems as problems
from deepfusion.engine.checkpoint.store import latest_checkpoint, load_checkpoint
from tests.mpi_util import HANG_GUARD, REAL_MPI, ROOT, deepfusion, run_mpi
from tests.plugins.heat import Heat, HeatWithoutReference
from tests.test_engine_mpi import train
from tests.tiny_configs import TINY, variant

HEAT = "tests.plugins.heat:Heat"
NO_REF = "tests.plugins.heat:HeatWithoutReference"
BROKEN = "tests.plugins.broken:Heat"


def config(tmp_path, name: str, *extra: str) -> str:
    path = tmp_path / "plugin.toml"
    path.write_text(variant(TINY, f'problem.name="{name}"', *extra))
    return str(path)


def records(run_dir, kind="step"):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


# -- resolution, in process -----------------------------------------------------------------------
def test_a_module_path_finds_the_class_and_its_spec_finds_it_again():
    assert problems.resolve(HEAT) is Heat
    assert problems.resolve(problems.problem_spec(Heat)) is Heat
    p = problems.get_problem(HEAT, grid=(9, 9), amplitude_range=(1, 2))
    assert type(p) is Heat and p.grid == (9, 9) and "amplitude_range" in problems.option_names(HEAT)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['nope'\] for problem 'heat'"):
        problems.get_problem(HEAT, nope=1)
    assert HEAT not in problems.PROBLEMS and "heat" not in problems.PROBLEMS  # found, not registered


def test_an_unknown_name_lists_the_valid_ones_and_how_to_name_a_class():
    with pytest.raises(ValueError) as e:
        problems.resolve("burgerz")
    msg = str(e.value)
    assert "did you mean 'burgers'" in msg and "'package.module:ClassName'" in msg
    assert "registered problems: " + ", ".join(sorted(problems.PROBLEMS)) in msg
    with pytest.raises(ValueError, match="written with a colon: 'tests.plugins.heat:Heat'"):
        problems.resolve("tests.plugins.heat.Heat")


@pytest.mark.parametrize("spec,needles", [
    (BROKEN, ["cannot import module 'tests.plugins.broken'", "ModuleNotFoundError",
              "a_module_that_is_not_installed", "PYTHONPATH"]),
    ("no_such_module_anywhere:Heat", ["cannot import module 'no_such_module_anywhere'"]),
    ("tests.plugins.heat:Hot", ["has no attribute 'Hot'", "Problem subclasses in it: Heat, "
                                                          "HeatWholeGrid, HeatWithoutReference"]),
    ("examples.heat:MODES", ["is a tuple, not a subclass of diffnet.problems.Problem"]),
    ("diffnet.problems.contract.base:Problem", ["does not implement", "'loss_terms'"]),
    ("tests.plugins.heat:", ["not of the form 'package.module:ClassName'"]),
])
def test_a_plugin_that_cannot_be_used_is_one_clear_error(spec, needles):
    with pytest.raises(ValueError) as e:
        problems.resolve(spec)
    assert all(n in str(e.value) for n in needles), str(e.value)


def test_register_adds_a_name_and_refuses_a_taken_one():
    class Local(HeatWithoutReference):
        name = "registered_heat"
    try:
        assert problems.register(Local) is Local and problems.resolve("registered_heat") is Local
        problems.register(Local)  # the same class again: fine
        with pytest.raises(ValueError, match="'burgers' is taken by diffnet.problems.families.burgers"):
            problems.register(name="burgers")(Local)
        with pytest.raises(ValueError, match="not a subclass"):
            problems.register(dict)
        with pytest.raises(ValueError, match="defined in a function"):
            problems.problem_spec(Local)  # a checkpoint naming it could never be read again
    finally:
        problems.PROBLEMS.pop("registered_heat", None)
    assert "registered_heat" not in problems.PROBLEMS


# -- entry points -----------------------------------------------------------------------------------
@pytest.fixture
def plugin_dist(tmp_path, monkeypatch):
    """An installed distribution in a directory on sys.path (and PYTHONPATH, for commands run in
    a new process), declaring two entry points of group diffnet.problems: no pip needed."""
    site = tmp_path / "site"
    info = site / "heat_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: heat-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[{problems.GROUP}]\nheat-ep = {HEAT}\nbroken-ep = {BROKEN}\n")
    monkeypatch.syspath_prepend(str(site))
    return str(site)


def test_an_entry_point_is_a_problem_name(plugin_dist, cli):
    assert {"heat-ep", "broken-ep"} <= set(problems.entry_point_names())
    assert problems.resolve("heat-ep") is Heat and problems.resolve("entry-point:heat-ep") is Heat
    with pytest.raises(ValueError) as e:
        problems.resolve("broken-ep")
    msg = str(e.value)
    assert "entry point broken-ep = 'tests.plugins.broken:Heat' of heat-plugin" in msg
    assert "a_module_that_is_not_installed" in msg
    rc, out, err = cli(["problems"])
    assert rc == 0 and "heat-ep" in out and "(plugin that cannot be loaded) broken-ep" in out
    rc, out, err = cli(["problems", "heat-ep"])
    assert rc == 0 and "amplitude_range" in out, err
    rc, _, err = cli(["problems", "nope"])
    assert rc == 2 and "installed plugins (entry points of group 'diffnet.problems'): " in err
    assert "broken-ep, heat-ep" in err


@pytest.mark.mpi
@pytest.mark.full
def test_an_entry_point_plugin_trains_and_answers_in_a_new_process(plugin_dist, tmp_path):
    env = {**REAL_MPI, "PYTHONPATH": os.pathsep.join([ROOT, plugin_dist])}
    cfg, d = config(tmp_path, "heat-ep", "train.max_steps=4"), str(tmp_path / "ep")
    p = run_mpi(1, ["-m", "deepfusion", "train", cfg, "--set", f"run.dir={d}"], env=env)
    assert p.returncode == 0, p.stderr
    meta = load_checkpoint(latest_checkpoint(d))["meta"]
    assert meta["problem"]["name"] == "entry-point:heat-ep"
    p = run_mpi(1, ["-m", "deepfusion", "infer", d, "--samples", "2", "--out",
                    str(tmp_path / "ep.h5")], env=env)
    assert p.returncode == 0 and "2 samples of heat" in p.stdout, p.stderr


# -- the whole workflow on a module-path plugin -------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.full
def test_a_plugin_trains_resumes_evaluates_infers_solves_and_compares(tmp_path, cli):
    cfg, d = config(tmp_path, HEAT), str(tmp_path / "heat")
    p = train(2, cfg, d, "train.max_steps=4", env=REAL_MPI)
    assert p.returncode == 0, p.stderr
    assert "validation relative L2 over 2 draws" in p.stdout
    meta = load_checkpoint(latest_checkpoint(d))["meta"]
    assert meta["problem"] == {"name": HEAT, "kwargs": {"grid": [16, 16],
                                                        "amplitude_range": [0.5, 1.5]}}
    p = deepfusion(2, ["train", "--resume", d, "--set", "train.max_steps=8"], env=REAL_MPI)
    assert p.returncode == 0, p.stderr
    resumed = [r["loss"] for r in records(d)]
    assert [r["step"] for r in records(d)] == list(range(1, 9))
    # the uninterrupted run, in this process (float64: the same losses on any number of ranks)
    rc, _, err = cli(["train", cfg, "--set", f"run.dir={tmp_path / 'whole'}",
                      "--set", "train.max_steps=8"])
    assert rc == 0, err
    assert resumed == pytest.approx([r["loss"] for r in records(str(tmp_path / "whole"))], rel=1e-9)

    p = deepfusion(0, ["evaluate", d, "--samples", "3"])             # each in a new process
    assert p.returncode == 0 and "test relative L2 over 3 draws" in p.stdout, p.stderr
    preds, refs = str(tmp_path / "pred.h5"), str(tmp_path / "ref.h5")
    p = deepfusion(0, ["infer", d, "--samples", "3", "--seed", "5", "--out", preds])
    assert p.returncode == 0 and "3 samples of heat 16x16" in p.stdout, p.stderr
    p = deepfusion(0, ["solve", "--problem", HEAT, "--samples", "3", "--seed", "5", "--out", refs])
    assert p.returncode == 0, p.stderr
    rc, out, err = cli(["compare", preds, refs, "--out", str(tmp_path)])
    assert rc == 0 and "relative L2 over 3 samples" in out, err


def test_a_checkpoint_whose_plugin_is_gone_names_it(tmp_path, cli):
    cfg, d = config(tmp_path, HEAT, "train.max_steps=2", "data.eval_samples=0"), str(tmp_path / "g")
    rc, _, err = cli(["train", cfg, "--set", f"run.dir={d}"])
    assert rc == 0, err
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # tests/ not importable
    p = subprocess.run([sys.executable, "-m", "deepfusion", "infer", d, "--samples", "1",
                        "--out", str(tmp_path / "x.h5")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=HANG_GUARD)
    assert p.returncode == 2, p.stderr
    assert f"was trained on problem '{HEAT}', which this process cannot find" in p.stderr
    assert "cannot import module 'tests.plugins.heat'" in p.stderr
    assert "Traceback" not in p.stderr


# -- no reference solver --------------------------------------------------------------------------------
def test_a_family_without_a_reference_trains_infers_and_says_what_it_cannot_do(tmp_path, cli):
    assert not problems.has_reference(HeatWithoutReference) and problems.has_reference(Heat)
    assert "reference_solution" not in problems.Problem.__abstractmethods__  # need not define it
    with pytest.raises(ValueError, match="'heat_no_reference' has no reference solver"):
        HeatWithoutReference().reference_solution([1.0, 1.0])
    cfg, d = config(tmp_path, NO_REF, "train.max_steps=8", "train.eval_every_epochs=1"), \
        str(tmp_path / "noref")
    rc, out, err = cli(["train", cfg, "--set", f"run.dir={d}"])
    assert rc == 0, err
    assert "validation loss (no reference solver, so no error) over 2 draws" in out
    summary = json.load(open(os.path.join(d, "eval.json")))
    assert summary["reference"] is False and set(summary["terms_mean"]) == {"pde", "bc"}
    loss = [p + b for p, b in zip(summary["terms"]["pde"], summary["terms"]["bc"])]
    assert summary["loss"] == pytest.approx(loss) and len(loss) == 2
    assert summary["loss_mean"] == pytest.approx(sum(loss) / 2) and loss[0] != loss[1]
    assert not os.path.exists(os.path.join(d, "eval.png"))
    evals = records(d, "eval")          # during training: the loss, no error
    assert evals and all("loss_mean" in r and "rel_l2_mean" not in r for r in evals)

    rc, out, err = cli(["evaluate", d, "--samples", "3"])
    assert rc == 0 and "test loss (no reference solver, so no error) over 3 draws" in out, err
    assert "term means: pde " in out
    preds = str(tmp_path / "p.h5")
    rc, out, err = cli(["infer", d, "--samples", "2", "--out", preds])
    assert rc == 0, err
    rc, _, err = cli(["solve", "--problem", NO_REF, "--samples", "2",
                      "--out", str(tmp_path / "r.h5")])
    assert rc == 2 and "has no reference solver" in err and "deepfusion evaluate" in err
    rc, _, err = cli(["compare", preds, preds, "--out", str(tmp_path)])
    assert rc == 2 and "has no reference solver" in err and "no reference to compare" in err
    rc, out, _ = cli(["problems", NO_REF])
    assert rc == 0 and "reference methods:  none: no reference solver" in out


@pytest.mark.mpi
def test_the_loss_report_of_a_split_run_equals_the_undivided_one(tmp_path, cli):
    """Without a reference, the validation under parallel.domain sums each term over the blocks:
    the same per-draw terms as the same run undivided (float64: equal trajectories)."""
    cfg = config(tmp_path, "tests.plugins.no_reference:PoissonWithoutReference",
                 "train.max_steps=2")
    split, whole = str(tmp_path / "split"), str(tmp_path / "whole")
    p = train(2, cfg, split, "parallel.domain=[1, 2]", env=REAL_MPI)
    assert p.returncode == 0, p.stderr
    rc, _, err = cli(["train", cfg, "--set", f"run.dir={whole}"])
    assert rc == 0, err
    a, b = (json.load(open(os.path.join(d, "eval.json"))) for d in (split, whole))
    assert a["reference"] is False and b["reference"] is False and len(a["loss"]) == 2
    for k in ("pde", "bc"):
        assert a["terms"][k] == pytest.approx(b["terms"][k], rel=1e-9, abs=1e-12), k


# -- config and problems commands ---------------------------------------------------------------------
def test_config_and_problems_describe_a_plugin(tmp_path, cli):
    rc, out, err = cli(["config", config(tmp_path, HEAT, "problem.options={amplitude_range=[1, 2]}")])
    assert rc == 0 and f'name = "{HEAT}"' in out, err
    rc, _, err = cli(["config", config(tmp_path, HEAT, "problem.options={amplitud=[1, 2]}")])
    assert rc == 2 and "did you mean 'amplitude_range'" in err
    rc, out, err = cli(["problems", HEAT])
    assert rc == 0 and out.startswith(f"{HEAT}: Steady heat conduction") and "amplitude_range" in out
    assert f"checkpoints record: '{HEAT}'" in out
    rc, _, err = cli(["config", config(tmp_path, BROKEN)])
    assert rc == 2 and "cannot import module 'tests.plugins.broken'" in err


@pytest.mark.mpi
def test_an_unimportable_plugin_ends_every_rank_with_one_message(tmp_path):
    d = tmp_path / "never"
    p = train(2, config(tmp_path, BROKEN), str(d))
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("deepfusion: error") == 1 and "Traceback" not in p.stderr
    assert f"problem.name: problem '{BROKEN}': cannot import" in p.stderr
    assert "a_module_that_is_not_installed" in p.stderr and not d.exists()


@pytest.mark.mpi
def test_a_plugin_that_refuses_a_domain_split_says_so_before_training(tmp_path):
    d = tmp_path / "split"
    p = train(2, config(tmp_path, "tests.plugins.heat:HeatWholeGrid"), str(d),
              "parallel.domain=[1, 2]")
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("deepfusion: error") == 1 and "Traceback" not in p.stderr
    assert ("parallel.domain = [1, 2]: problem 'heat_whole_grid' computes its loss term(s) "
            "['pde'] on the whole grid only") in p.stderr
    assert not d.exists()
