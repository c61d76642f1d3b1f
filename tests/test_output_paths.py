"""Every command that writes checks its output path before the work (deepfusion/app/outputs.py):
never onto a checkpoint, a file a run keeps or its own inputs, never into a directory that does
not exist; exit 2 with one line, nothing written, nothing changed (issue #69, items 6, 11, 12)."""
import glob
import os

import pytest

from deepfusion.cli import main
from deepfusion.jobs import render as R
from tests.tiny_configs import TINY, variant

SITE = ["--cluster", "generic-slurm", "--partition", "cpu", "--account", "", "--no-check"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run of 4 steps with its checkpoint at step 4, trained in this process."""
    d = tmp_path_factory.mktemp("out")
    cfg = d / "tiny.toml"
    cfg.write_text(variant(TINY, "train.max_steps=4", "train.checkpoint_every=4"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPFUSION_NO_MPI", "1")
        assert main(["train", str(cfg), "--set", f"run.dir={d / 'run'}"]) == 0
    return str(d / "run")


def snapshot(*paths) -> dict:
    """Every file under ``paths`` (files or directories) -> its bytes."""
    files = []
    for p in paths:
        files += [p] if os.path.isfile(p) else glob.glob(os.path.join(p, "**"), recursive=True)
    return {f: open(f, "rb").read() for f in files if os.path.isfile(f)}


def refused(cli, args, says, *kept):
    before = snapshot(*kept)
    rc, out, err = cli(args)
    assert rc == 2, (rc, err)
    assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert snapshot(*kept) == before
    return err


def newest(run):
    return sorted(glob.glob(os.path.join(run, "checkpoints", "step_*.h5")))[-1]


def test_infer_never_writes_onto_a_checkpoint(run, cli):
    ckpt = newest(run)
    err = refused(cli, ["infer", run, "--samples", "2", "--out", ckpt],
                  "is inside the checkpoints directory of the run", run)
    assert err.startswith("deepfusion: error: --out ")
    refused(cli, ["infer", ckpt, "--samples", "2", "--out", ckpt], "inputs", run)
    refused(cli, ["infer", run, "--samples", "2", "--out", os.path.join(run, "metrics.jsonl")],
            "a file the run in", run)


def test_infer_never_writes_onto_its_inputs(run, cli, tmp_path):
    rc, _, err = cli(["infer", run, "--samples", "2", "--out", str(tmp_path / "p.h5")])
    assert rc == 0, err
    refused(cli, ["infer", run, "--inputs", str(tmp_path / "p.h5"), "--out",
                  str(tmp_path / "p.h5")], "is one of this command's inputs", str(tmp_path))
    params = tmp_path / "params.txt"
    params.write_text("0.01\n0.02\n")
    refused(cli, ["infer", run, "--params", str(params), "--out", str(params)],
            "is one of this command's inputs", str(params))
    refused(cli, ["solve", "--problem", "burgers", "--params", str(params), "--out", str(params)],
            "is one of this command's inputs", str(params))


def test_evaluate_checks_out_before_the_evaluation(run, cli, tmp_path):
    err = refused(cli, ["evaluate", run, "--samples", "2", "--out", str(tmp_path / "no" / "e.json")],
                  "does not exist; create it or choose another", run)
    assert "relative L2" not in err
    refused(cli, ["evaluate", run, "--samples", "2", "--out", os.path.join(run, "config.toml")],
            "a file the run in", run)
    rc, out, err = cli(["evaluate", run, "--samples", "2", "--out",
                        os.path.join(run, "eval_seed7.json")])  # a run's own summary: allowed
    assert rc == 0 and "eval_seed7.json" in out, err


def test_export_and_compare_refuse_a_run_file_or_a_missing_directory(run, cli, tmp_path):
    refused(cli, ["export", run, "--format", "torchscript", "--out", newest(run)],
            "checkpoints directory", run)
    refused(cli, ["compare", str(tmp_path / "a.h5"), str(tmp_path / "b.h5"), "--out",
                  str(tmp_path / "no")], "the directory does not exist", str(tmp_path))


def test_jobs_render_out_is_checked(run, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.mkdir("runs")
    for out, says in (("nodir/j.sh", "does not exist; create it or choose another"),
                      ("runs", "is a directory"),
                      (newest(run), "checkpoints directory")):
        before = snapshot(run)
        assert R.main([*SITE, "--out", out]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --out ") and says in err and "Traceback" not in err, err
        assert snapshot(run) == before
    assert not os.path.exists("nodir") and os.listdir("runs") == []


@pytest.mark.parametrize("time", ["99:99:99", "1-24:00:00", "10:60", "noon", "1-2:3"])
def test_jobs_render_refuses_a_time_slurm_would_not_take(time, tmp_path, capsys):
    assert R.main([*SITE, "--time", time, "--out", str(tmp_path / "j.sh")]) == 2
    err = capsys.readouterr().err
    assert "is not a Slurm time limit" in err and "D-HH:MM:SS" in err, err
    assert not (tmp_path / "j.sh").exists()


@pytest.mark.parametrize("time", ["02:00:00", "48:00:00", "1-12:00:00", "90", "1-2"])
def test_jobs_render_takes_the_slurm_forms(time, tmp_path):
    assert R.main([*SITE, "--time", time, "--out", str(tmp_path / "j.sh")]) == 0
    assert f"#SBATCH -t {time}" in (tmp_path / "j.sh").read_text()


def test_jobs_directory_outputs_are_checked(run, tmp_path, capsys):
    from deepfusion.jobs import model, project, sweep

    ckpts = os.path.join(run, "checkpoints")
    assert model.main(["--t-sample", "0.1", "--out", ckpts]) == 2
    assert sweep.main(["--config", "x.toml", "--layouts", "1x1", "--mode", "strong",
                       "--steps", "2", "--out", os.path.join(ckpts, "sw")]) == 2
    (tmp_path / "f").write_text("")
    assert project.main(["--config", "x.toml", "--out", str(tmp_path / "f")]) == 2
    err = capsys.readouterr().err
    assert err.count("checkpoints directory") == 2 and "is a file, not a directory" in err, err
    assert not os.path.exists(os.path.join(ckpts, "sw"))
