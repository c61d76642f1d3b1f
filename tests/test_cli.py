"""The command line speaks one language: the spellings shared by the commands, their help, one
spelling per flag (earlier spellings and abbreviations are refused), ``--version``,
``deepfusion problems``, ``deepfusion config --markdown`` and the configuration reference it
keeps in the manual."""
import argparse
import configparser
import dataclasses
import pathlib
from importlib.metadata import version

import h5py
import numpy as np
import pytest

import deepfusion

from deepfusion.cli import build_parser, main
from deepfusion.app.options import THREADS_HELP, set_options
from deepfusion.config.reference import BEGIN, END, between, markdown_reference, splice
from deepfusion.config.sections import SECTIONS
from diffnet.problems import PROBLEMS, option_names
from deepfusion.jobs import model as jobs_model
from deepfusion.jobs import render as jobs_render
from deepfusion.jobs import sweep as jobs_sweep
ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"
REGENERATE = "python -m deepfusion.config.reference docs/configuration.md"
JOBS = {"render": jobs_render, "sweep": jobs_sweep, "model": jobs_model}


def subparsers(parser, name="deepfusion"):
    """(command name, parser) of the parser and of every subcommand, jobs tools included."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                yield from subparsers(p, f"{name} {sub}")
    if name == "deepfusion":
        for tool, module in JOBS.items():
            yield f"deepfusion jobs {tool}", module.build_parser()


def actions(parser, flag):
    return [a for a in parser._actions if flag in a.option_strings]


def command(name):
    return dict(subparsers(build_parser()))[f"deepfusion {name}"]


def test_every_option_of_every_command_has_help():
    missing = [(name, a.option_strings or a.dest) for name, p in subparsers(build_parser())
               for a in p._actions
               if not isinstance(a, argparse._SubParsersAction)
               and (a.help is None or not str(a.help).strip())]
    assert not missing, f"options without a help text: {missing}"


def test_the_shared_flags_are_spelt_and_explained_alike():
    for name in ("evaluate", "infer", "solve"):
        p = command(name)
        (threads,) = actions(p, "--threads")
        assert threads.default == 0 and threads.help == THREADS_HELP, name
        (s,) = actions(p, "--set")
        assert "problem.options.KEY=VALUE" in s.help and s.metavar == "problem.options.KEY=VALUE"
        assert not actions(p, "--option"), name
        assert "--samples" in p.format_help() and "--option" not in p.format_help()
    assert "--threads 1" in THREADS_HELP and "identical" in THREADS_HELP
    for name in ("infer", "solve"):
        p = command(name)
        assert not actions(p, "--sample")
        assert "inputs (exactly one of --samples / --params / --inputs)" in p.format_help()
        assert "--sample " not in p.format_help()


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert capsys.readouterr().out.strip() == f"deepfusion {deepfusion.__version__}"
    # one place states the version: setup.cfg reads it from the package
    assert cfg["metadata"]["version"] == "attr: deepfusion.__version__"
    assert version("deepfusion") == deepfusion.__version__


@pytest.mark.parametrize("tool", sorted(JOBS))
def test_jobs_tools_name_themselves_as_deepfusion_jobs(tool, capsys):
    with pytest.raises(SystemExit):
        main(["jobs", tool, "--help"])
    out = capsys.readouterr().out
    assert out.startswith(f"usage: deepfusion jobs {tool} ") and "python -m jobs" not in out


def test_cluster_help_lists_the_profiles():
    profiles = sorted(jobs_render.load_profiles())
    for module in (jobs_render, jobs_sweep):
        (cluster,) = actions(module.build_parser(), "--cluster")
        assert "see --list" not in cluster.help
        assert all(name in cluster.help for name in profiles), cluster.help
    with pytest.raises(ValueError, match="valid clusters: " + ", ".join(profiles)):
        jobs_render.get_profile("nope")


def test_sweep_time_and_its_old_spelling_refused(tmp_path, capsys):
    p = jobs_sweep.build_parser()
    assert p.parse_args(["--out", "x", "--time", "01:00:00"]).time == "01:00:00"
    assert not actions(p, "--time-limit") and "--time-limit" not in p.format_help()
    args = ["--aggregate-only", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as e:
        jobs_sweep.main(args + ["--time-limit", "00:10:00"])
    assert e.value.code == 2
    assert "unrecognized arguments: --time-limit 00:10:00" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# --set problem.options.KEY=VALUE
# ---------------------------------------------------------------------------------------------

def test_set_reads_toml_values_under_problem_options():
    got = set_options(["problem.options.n=6", "problem.options.r=[-2, 2]",
                       'problem.options.f="fine-scale"', "problem.options.g=bare",
                       "problem.options.t.a=1", "problem.options.b=true"], "solve")
    assert got == {"n": 6, "r": [-2, 2], "f": "fine-scale", "g": "bare", "t": {"a": 1},
                   "b": True}
    for bad in ("train.lr=1", "problem.grid=[8, 8]", "problem.options=1", "options.n=1",
                "problem.options.n"):
        with pytest.raises(ValueError, match="solve takes only problem options, --set "
                                             "problem.options.KEY=VALUE"):
            set_options([bad], "solve")


def solve(cli, tmp_path, name, *flags):
    out = str(tmp_path / f"{name}.h5")
    rc, _, err = cli(["solve", "--problem", "poisson", "--grid", "9x9", "--out", out, *flags])
    return rc, err, out


def test_old_spellings_are_refused(tmp_path, cli, capsys):
    """--samples N and --set problem.options.KEY=VALUE (TOML) are the spellings; the earlier
    --sample N and --option KEY=VALUE (JSON) are unrecognized arguments (exit 2), as is an
    abbreviation of a flag."""
    rc, err, new = solve(cli, tmp_path, "new", "--samples", "2", "--set",
                         "problem.options.omega_range=[-1, 1]")
    assert rc == 0, err
    with h5py.File(new) as a:
        assert a["u"].shape[0] == 2
    out = str(tmp_path / "old.h5")
    solve_old = ["solve", "--problem", "poisson", "--grid", "9x9", "--out", out]
    for old in (solve_old + ["--sample", "2"], solve_old + ["--samp", "2"],
                solve_old + ["--samples", "2", "--option", "omega_range=[-1,1]"],
                ["evaluate", str(tmp_path), "--option", "omega_range=[-1,1]"]):
        with pytest.raises(SystemExit) as e:
            main(old)
        err = capsys.readouterr().err
        assert e.value.code == 2 and "unrecognized arguments: " + " ".join(old[-2:]) in err, err
    assert not pathlib.Path(out).exists()


def test_set_outside_problem_options_is_refused_with_the_accepted_keys(tmp_path, cli):
    rc, err, _ = solve(cli, tmp_path, "x", "--samples", "1", "--set", "optim.lr=1")
    assert rc == 2 and "takes only problem options" in err and "problem.options.KEY" in err
    rc, err, _ = solve(cli, tmp_path, "x", "--samples", "1", "--set", "problem.options.grid=[9,9]")
    assert rc == 2 and "give the grid with --grid" in err
    rc, err, _ = solve(cli, tmp_path, "x", "--samples", "1", "--set", "problem.options.bogus=1")
    assert rc == 2 and "unknown option(s) ['bogus']" in err


# ---------------------------------------------------------------------------------------------
# deepfusion problems
# ---------------------------------------------------------------------------------------------

def test_problems_lists_the_registry(cli):
    rc, out, _ = cli(["problems"])
    assert rc == 0
    for name, cls in PROBLEMS.items():
        assert name in out and ", ".join(cls.input_channels) in out


@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_one_problem_in_detail(name, cli):
    rc, out, _ = cli(["problems", name])
    assert rc == 0
    options = [k for k in option_names(name) if k != "grid"]
    for k in options:
        assert f"    {k} " in out, k
    assert f"{PROBLEMS[name].dims}-D" in out
    assert all(m in out for m in PROBLEMS[name].reference_methods)


def test_problems_markdown_and_an_unknown_name(cli):
    rc, out, _ = cli(["problems", "--markdown"])
    assert rc == 0 and out.startswith("| Problem |")
    for name in PROBLEMS:
        assert f"### {name}\n" in out
    rc, _, err = cli(["problems", "nope"])
    assert rc == 2 and "registered problems: " + ", ".join(sorted(PROBLEMS)) in err


# ---------------------------------------------------------------------------------------------
# deepfusion config
# ---------------------------------------------------------------------------------------------

def test_config_markdown_holds_every_key(cli):
    rc, out, _ = cli(["config", "--markdown"])
    assert rc == 0 and out == markdown_reference()
    for name, cls in SECTIONS.items():
        assert f"### [{name}]" in out
        for key in (f.name for f in dataclasses.fields(cls)):
            assert f"| `{name}.{key}` |" in out, f"{name}.{key}"
    assert "| `train.levels[i].grid` |" in out
    rc, _, err = cli(["config", "configs/demo.toml", "--markdown"])
    assert rc == 2 and "give no FILE" in err


def test_the_manual_holds_the_current_reference():
    page = PAGE.read_text()
    assert BEGIN in page and END in page
    assert between(page) == markdown_reference(), (
        f"docs/configuration.md's configuration reference (between {BEGIN} and {END}) differs "
        f"from 'deepfusion config --markdown': regenerate it with `{REGENERATE}`")
    assert splice(page, markdown_reference()) == page


def test_config_checks_problem_and_model_option_names(cli):
    rc, out, err = cli(["config", "configs/demo.toml", "--set", "problem.options.smoothin=0.1"])
    assert rc == 2 and "'problem.options.smoothin'; did you mean 'smoothing'?" in err
    rc, out, err = cli(["config", "configs/demo.toml", "--set", "model.options.dept=3"])
    assert rc == 2 and "did you mean 'depth'?" in err
    rc, out, err = cli(["config", "configs/demo.toml", "--set", "problem.name=nope"])
    assert rc == 2 and "registered problems" in err
    rc, out, err = cli(["config", "--set", "train.epochs=3"])
    assert rc == 0 and "epochs = 3" in out and "problem.name is not set" in err
