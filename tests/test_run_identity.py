"""A run's identity (deepfusion.engine.run.identity) and a refused resume that changes nothing:
another run's checkpoint is never resumed silently, and a resume refused for its checkpoint or
its network leaves config.toml as it was."""
import json
import shutil

from deepfusion.engine.checkpoint import store as ckpt
from deepfusion.engine.run.identity import RUN_ID, read_run_id
from tests.tiny_configs import TINY, variant


def train(cli, tmp_path, name, *sets):
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(variant(TINY, "train.max_steps=4", "train.checkpoint_every=4", *sets))
    run = tmp_path / name
    rc, _, err = cli(["train", str(cfg), "--set", f"run.dir={run}"])
    assert rc == 0, err
    return run


def with_anothers_checkpoint(cli, tmp_path, name: str, step: int):
    """Runs a (seed 1) and ``name``, a's newest checkpoint copied into ``name``'s as step
    ``step``: (a, the run, the copy)."""
    a = train(cli, tmp_path, "a", "train.init_seed=1")
    x = train(cli, tmp_path, name)
    theirs, _ = ckpt.find_checkpoint(str(a))
    copied = x / "checkpoints" / f"step_{step:08d}.h5"
    shutil.copy(theirs, copied)
    return a, x, copied


def files(run):
    return {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}


def test_every_record_and_checkpoint_carries_the_run_id(tmp_path, cli):
    run = train(cli, tmp_path, "a")
    rid = read_run_id(str(run))
    assert rid and len(rid) == 16
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert recs and all(r["run"] == rid for r in recs)
    path, _ = ckpt.find_checkpoint(str(run))
    assert ckpt.load_checkpoint(path)["meta"]["run_id"] == rid


def test_another_runs_checkpoint_is_refused_naming_both(tmp_path, cli):
    a, x, copied = with_anothers_checkpoint(cli, tmp_path, "x", 8)
    before = files(x)
    rc, _, err = cli(["train", "--resume", str(x), "--set", "train.max_steps=12"])
    assert rc == 2, err
    assert f"was written by another run (id {read_run_id(str(a))}" in err
    assert f"not by this one (id {read_run_id(str(x))})" in err
    assert f"--set model.init_from={copied}" in err
    assert files(x) == before                       # nothing of the run changed


def test_a_refused_resume_leaves_config_toml_as_it_was(tmp_path, cli):
    run = train(cli, tmp_path, "r")
    for p in (run / "checkpoints").iterdir():
        p.write_bytes(b"")                          # no loadable checkpoint
    before = (run / "config.toml").read_text()
    rc, _, err = cli(["train", "--resume", str(run), "--set", "optim.lr=0.5",
                      "--set", "train.max_steps=99"])
    assert rc == 2 and "start over in it with --overwrite" in err, err
    assert (run / "config.toml").read_text() == before


def test_a_changed_network_on_resume_is_refused_and_the_run_still_resumes(tmp_path, cli):
    run = train(cli, tmp_path, "n")
    before = files(run)
    rc, _, err = cli(["train", "--resume", str(run), "--set",
                      "model.options={depth=2,base_width=8}"])
    assert rc == 2 and "a resume continues the same network" in err, err
    assert "Traceback" not in err and files(run) == before
    rc, _, err = cli(["train", "--resume", str(run), "--set", "train.max_steps=6"])
    assert rc == 0, err


def test_a_run_of_an_earlier_version_takes_an_id_at_its_first_resume(tmp_path, cli):
    run = train(cli, tmp_path, "old")
    (run / RUN_ID).unlink()
    rc, _, err = cli(["train", "--resume", str(run), "--set", "train.max_steps=6"])
    assert rc == 0, err
    assert read_run_id(str(run))


def test_a_resume_reads_its_checkpoint_once_and_says_what_it_skipped(tmp_path, cli,
                                                                      monkeypatch):
    """The launch's check and the trainer's resume share rank 0's one read of the newest
    checkpoint; a damaged newer one is still skipped with a warning, once."""
    import os

    run = train(cli, tmp_path, "once")
    newest, _ = ckpt.find_checkpoint(str(run))
    (run / "checkpoints" / "step_00000099.h5").write_bytes(b"not a checkpoint")
    reads, real = [], ckpt.load_checkpoint

    def counting(path, notes=None):
        reads.append(os.path.basename(path))
        return real(path, notes)

    monkeypatch.setattr(ckpt, "load_checkpoint", counting)
    rc, out, err = cli(["train", "--resume", str(run), "--set", "train.max_steps=6"])
    assert rc == 0, err
    assert reads.count(os.path.basename(newest)) == 1, reads
    assert err.count("skipped checkpoint step_00000099.h5") == 1, err
    assert f"resumed from {newest} at step 4" in out + err


def test_a_deleted_run_id_still_refuses_another_runs_checkpoint(tmp_path, cli):
    """The records carry the run's id: deleting run_id does not let another run's file in."""
    _, x, _ = with_anothers_checkpoint(cli, tmp_path, "x", 12)
    ours = read_run_id(str(x))
    (x / RUN_ID).unlink()
    before = files(x)
    rc, _, err = cli(["train", "--resume", str(x), "--set", "train.max_steps=14"])
    assert rc == 2 and f"not by this one (id {ours})" in err, err
    assert files(x) == before


def test_a_resume_that_changes_the_problem_or_the_start_is_refused(tmp_path, cli):
    a = train(cli, tmp_path, "a")
    x = train(cli, tmp_path, "x")
    before = files(x)
    other, _ = ckpt.find_checkpoint(str(a))
    for sets, said in ((['problem.name="poisson"'], "a resume continues the same PDE"),
                       ([f"model.init_from={other}"], "a resume continues this run's own")):
        args = ["train", "--resume", str(x), "--set", "train.max_steps=6"]
        rc, _, err = cli(args + [a for s in sets for a in ("--set", s)])
        assert rc == 2 and said in err, err
        assert files(x) == before


def test_a_config_naming_another_run_dir_is_refused_on_resume(tmp_path, cli):
    x = train(cli, tmp_path, "x")
    other = tmp_path / "other.toml"
    other.write_text(variant(TINY, "train.max_steps=6", f'run.dir="{tmp_path / "elsewhere"}"'))
    before = files(x)
    rc, _, err = cli(["train", str(other), "--resume", str(x)])
    assert rc == 2 and "names run.dir" in err and "drop --resume" in err, err
    assert files(x) == before
    # a job script's form: the config, --set run.dir and --resume naming one directory
    rc, _, err = cli(["train", str(other), "--set", f"run.dir={x}", "--resume", str(x)])
    assert rc == 0, err


def test_check_and_jobs_render_refuse_another_runs_checkpoint_as_train_does(tmp_path, cli,
                                                                            capsys):
    from deepfusion.jobs import render

    _, y, _ = with_anothers_checkpoint(cli, tmp_path, "y", 12)
    rc, _, err = cli(["check", "--resume", str(y), "--ranks", "1", "--no-probe"])
    assert rc == 2 and "was written by another run" in err, err
    job = tmp_path / "job.sh"
    capsys.readouterr()
    rc = render.main(["--cluster", "local", "--ranks-per-node", "1", "--config",
                      str(tmp_path / "y.toml"), "--run-dir", str(y), "--out", str(job)])
    err = capsys.readouterr().err
    assert rc == 2 and "was written by another run" in err and not job.exists(), err


def test_infer_on_a_run_directory_refuses_another_runs_checkpoint(tmp_path, cli):
    _, x, copied = with_anothers_checkpoint(cli, tmp_path, "x", 12)
    rc, _, err = cli(["infer", str(x), "--samples", "1", "--out", str(tmp_path / "p.h5")])
    assert rc == 2 and "was written by another run" in err and str(copied) in err, err
    assert not (tmp_path / "p.h5").exists()
    rc, _, err = cli(["infer", str(copied), "--samples", "1", "--out", str(tmp_path / "p.h5")])
    assert rc == 0, err                                  # the file named on purpose
