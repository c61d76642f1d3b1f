"""jobs render / jobs sweep before anything is written or submitted: the job's `deepfusion train`
start-up checked for its ranks (train's message, exit 2), placeholders refused, and the shape of
the script (the environment activated, modules before `set -u`, absolute CONFIG and RUN_DIR)."""
from __future__ import annotations

import re
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from deepfusion.app.check import check_launch
from deepfusion.engine.errors import InputError
from deepfusion.jobs import render as R
from deepfusion.jobs import sweep as S
from deepfusion.jobs.precheck import absolute, default_setup
from deepfusion.jobs.sweep_sbatch import site_profiles

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "configs" / "recipes" / "burgers.toml")  # global batch 16
SITE = ["--partition", "cpu", "--account", ""]


def render_cli(capsys, *argv):
    """``jobs render`` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    rc = R.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def train_message(config, sets, ranks) -> str:
    """The refusal deepfusion train would print on ``ranks`` ranks (the shared checks)."""
    with pytest.raises(InputError) as e:
        check_launch(config, sets, ranks, here=False)
    return str(e.value)


@pytest.mark.parametrize("argv,sets,ranks", [
    (["--nodes", "4", "--ranks-per-node", "8", "--threads-per-rank", "6"], [], 32),
    (["--nodes", "1", "--ranks-per-node", "2", "--threads-per-rank", "1", "--set", "optim.lrr=1"],
     ["optim.lrr=1"], 2),
    (["--nodes", "1", "--ranks-per-node", "2", "--threads-per-rank", "1", "--set",
      "model.options={depht=4}"], ["model.options={depht=4}"], 2),
    (["--nodes", "1", "--ranks-per-node", "2", "--threads-per-rank", "1", "--set",
      "problem.grid=[50,50]"], ["problem.grid=[50,50]"], 2),
])
def test_render_refuses_what_train_would_refuse(tmp_path, capsys, argv, sets, ranks):
    """4 nodes x 8 ranks of a recipe with global batch 16, an unknown key, a model option typo,
    a grid the network cannot take: exit 2 with train's own message, and no script written."""
    out = tmp_path / "job.sh"
    rc, _, err = render_cli(capsys, "--cluster", "generic-slurm", *SITE, "--config", RECIPE, *argv,
                            "--out", str(out))
    assert rc == 2 and not out.exists()
    said = train_message(RECIPE, [*sets, f"parallel.threads_per_rank={argv[5]}"], ranks)
    assert said.startswith("(rank 0) ") and said in err, err
    assert f"deepfusion train on {ranks} rank(s)" in err and "would refuse this job" in err
    if ranks == 32:
        assert "data.global_batch = 16 is not divisible by the number of ranks P = 32" in err
    rc, _, _ = render_cli(capsys, "--cluster", "generic-slurm", *SITE, "--config", RECIPE, *argv,
                          "--out", str(out), "--no-check")
    assert rc == 0 and out.exists()  # --no-check: a config only the compute nodes can read


def test_render_refuses_a_missing_config(capsys):
    rc, _, err = render_cli(capsys, "--cluster", "local", "--ranks-per-node", "1",
                            "--config", "/nonexistent.toml", "--set", "optim.lrr=1")
    assert rc == 2 and "config file not found: /nonexistent.toml" in err, err


@pytest.mark.parametrize("cluster,flags,field,hint", [
    ("generic-slurm", [], "partition", "--partition NAME"),
    ("generic-slurm", ["--partition", "cpu"], "account", "--account NAME"),
    ("stampede2", [], "account", "--account NAME"),
])
def test_render_refuses_placeholders_naming_the_field_and_the_fix(capsys, cluster, flags, field, hint):
    rc, _, err = render_cli(capsys, "--cluster", cluster, *flags, "--config", RECIPE)
    assert rc == 2 and f"field '{field}' is still the placeholder 'YOUR_" in err, err
    assert hint in err and "--profiles FILE" in err and f"[{cluster}]" in err


def test_placeholders_set_by_flags_or_a_profile_file(tmp_path, capsys):
    rc, text, _ = render_cli(capsys, "--cluster", "generic-slurm", "--partition", "cpu", "--account",
                             "proj", "--nodes", "2", "--ranks-per-node", "2", "--config", RECIPE)
    assert rc == 0 and "#SBATCH -p cpu\n" in text and "#SBATCH -A proj\n" in text
    mine = tmp_path / "site.toml"
    mine.write_text('[generic-slurm]\npartition = "batch"\naccount = ""\n')
    rc, text, _ = render_cli(capsys, "--cluster", "generic-slurm", "--profiles", str(mine), "--config", RECIPE)
    assert rc == 0 and "#SBATCH -p batch\n" in text and "#SBATCH -A" not in text


def test_render_warns_at_the_data_parallel_limit(capsys):
    """16 ranks on a global batch of 16: allowed, but one sample per rank."""
    rc, _, err = render_cli(capsys, "--cluster", "generic-slurm", *SITE, "--nodes", "2",
                            "--ranks-per-node", "8", "--threads-per-rank", "6", "--config", RECIPE)
    assert rc == 0 and "warning: data.global_batch: global batch 16 on 16 data-parallel unit(s)" in err


def test_render_judges_a_literal_run_dir_as_the_script_starts_on_it(tmp_path, capsys):
    """The script adds --resume when RUN_DIR/checkpoints exists: a run directory holding only
    metrics.jsonl is refused with train's message, and so is one whose checkpoints/ holds none
    that loads (a run resumed from one: tests/test_edge_messages.py)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    argv = ["--cluster", "local", "--ranks-per-node", "1", "--config", RECIPE, "--run-dir", str(run)]
    rc, _, err = render_cli(capsys, *argv)
    assert rc == 2 and f"run directory '{run}' already holds a run" in err, err
    (run / "checkpoints").mkdir()
    rc, _, err = render_cli(capsys, *argv)
    assert rc == 2 and f"would refuse this job: --resume {run}: no loadable checkpoint" in err


def test_script_activates_the_environment_and_loads_modules_before_set_u(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative CONFIG and RUN_DIR become absolute from here
    (tmp_path / "c.toml").write_text(Path(RECIPE).read_text())
    rc, text, _ = render_cli(capsys, "--cluster", "openmpi-srun", *SITE, "--nodes", "2",
                             "--config", "c.toml", "--run-dir", "runs/x")
    assert rc == 0
    assert f'CONFIG="{tmp_path}/c.toml"\n' in text and f'RUN_DIR="{tmp_path}/runs/x"\n' in text
    module, activate = text.index("module load openmpi\n"), text.index(default_setup()[0] + "\n")
    assert module < activate < text.index("\nset -uo pipefail\n")
    assert sys.prefix != sys.base_prefix and default_setup() == [f"source {sys.prefix}/bin/activate"]
    assert re.search(r"^srun .*--cpu-bind=cores --kill-on-bad-exit=1 --mpi=pmix ", text, re.M)
    script = tmp_path / "job.sh"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    default = R.render("local", 1, 1, 1)
    assert f'RUN_DIR="{tmp_path}/runs/deepfusion-${{SLURM_JOB_ID:-local}}"' in default
    assert absolute("$SCRATCH/run") == "$SCRATCH/run" and absolute("/a/../b") == "/a/../b"


def test_profile_setup_replaces_the_default_activation(tmp_path):
    mine = tmp_path / "site.toml"
    mine.write_text('[mpich-srun]\npartition = "cpu"\naccount = ""\n'
                    'setup = ["source /opt/df/bin/activate", "export FOO=1"]\n[local]\nsetup = []\n')
    text = R.render("mpich-srun", 1, profiles=str(mine))
    assert "\nsource /opt/df/bin/activate\nexport FOO=1\nset -uo pipefail\n" in text
    assert "--mpi=pmi2 " in text and default_setup()[0] not in text
    assert "/bin/activate" not in R.render("local", 1, 1, 1, profiles=str(mine))
    mine.write_text('[local]\nsetup = "source x"\n')
    with pytest.raises(ValueError, match="'setup' must be list"):
        R.load_profiles(mine)


def test_sweep_checks_every_layout_before_running(tmp_path, capsys):
    """An unknown key or a layout train refuses: exit 2 before any layout runs (no run dirs)."""
    out = tmp_path / "sweep"
    base = ["--config", RECIPE, "--layouts", "1x1", "--steps", "2", "--global-batch", "4", "--out", str(out)]
    assert S.main([*base, "--set", "optim.lrr=1"]) == 2
    assert "unknown key 'optim.lrr'; did you mean 'optim.lr'?" in capsys.readouterr().err
    assert S.main([*base, "--set", "problem.grid=[50,50]"]) == 2
    assert "does not suit model 'unet'" in capsys.readouterr().err
    assert not (out / "runs").exists()


def test_sweep_sbatch_profile_placeholders(tmp_path):
    args = Namespace(profiles=None, cluster="generic-slurm", sbatch_args="", partition=None, account=None)
    with pytest.raises(ValueError, match="field 'partition' is still the placeholder"):
        site_profiles(args)
    args.sbatch_args = "-p debug"  # sbatch's own option wins: the #SBATCH -p line is left out
    with pytest.raises(ValueError, match="field 'account'"):
        site_profiles(args)
    args.account = "proj"
    prof = site_profiles(args)["generic-slurm"]
    assert (prof["partition"], prof["account"]) == ("", "proj")
