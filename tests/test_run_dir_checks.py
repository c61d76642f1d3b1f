"""Launch checks of the run directory that change nothing when they refuse: a read-only or
full directory, and options that contradict --resume (deepfusion.app.preflight)."""
import os
import shutil

import pytest

from deepfusion.app import preflight
from tests.tiny_configs import TINY, variant


@pytest.fixture
def tiny_run(tmp_path, cli):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(variant(TINY, "train.max_steps=4", "train.checkpoint_every=4"))
    run = tmp_path / "run"
    assert cli(["train", str(cfg), "--set", f"run.dir={run}"])[0] == 0
    return cfg, run


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_checkpoints_directory_is_refused_at_the_start(tiny_run, cli):
    cfg, run = tiny_run
    os.chmod(run / "checkpoints", 0o555)
    try:
        rc, _, err = cli(["train", "--resume", str(run), "--set", "train.max_steps=8"])
    finally:
        os.chmod(run / "checkpoints", 0o755)
    assert rc == 2 and f"cannot write in {run / 'checkpoints'}" in err, err


def test_an_unwritable_directory_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    d = tmp_path / "run"
    (d / "checkpoints").mkdir(parents=True)

    def refuse(prefix, dir):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(preflight.tempfile, "mkstemp", refuse)
    with pytest.raises(ValueError, match=r"cannot write in .*run: Permission denied.*chmod u\+w"):
        preflight.check_writable(str(d))


def test_a_full_directory_is_refused(tmp_path, monkeypatch):
    d = tmp_path / "run"
    (d / "checkpoints").mkdir(parents=True)
    (d / "checkpoints" / "step_00000004.h5").write_bytes(bytes(1000))
    monkeypatch.setattr(preflight.shutil, "disk_usage",
                        lambda p: shutil._ntuple_diskusage(10 << 30, 10 << 30, 1 << 20))
    with pytest.raises(ValueError, match=r"has 1 MB free, less than the 64 MB"):
        preflight.check_writable(str(d))


@pytest.mark.parametrize("extra,message", [
    (["--set", "run.dir=elsewhere"], "names another directory"),
    (["--overwrite"], "give one of them"),
])
def test_options_that_contradict_resume_are_refused_and_change_nothing(tiny_run, cli, extra, message):
    cfg, run = tiny_run
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    rc, _, err = cli(["train", "--resume", str(run), *extra])
    assert rc == 2 and message in err, err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert not os.path.exists("elsewhere")
    rc, _, err = cli(["train", "--resume", str(run), "--set", f"run.dir={run}",
                      "--set", "train.max_steps=6"])
    assert rc == 0, err                      # naming the same directory is no contradiction


def test_a_records_file_the_run_cannot_replace_is_refused_at_the_start(tiny_run, cli,
                                                                       monkeypatch):
    """metrics.jsonl a directory, or a file the process may not write (immutable, read-only):
    exit 2 naming it before anything is written, not a traceback at its first rewrite."""
    cfg, run = tiny_run
    config = (run / "config.toml").read_text()
    records = run / "metrics.jsonl"
    kept = records.read_bytes()
    records.unlink()
    records.mkdir()
    rc, _, err = cli(["train", "--resume", str(run), "--set", "train.max_steps=8"])
    assert rc == 2 and f"{records} is not a regular file" in err and "Traceback" not in err, err
    records.rmdir()
    records.write_bytes(kept)
    real = os.access
    monkeypatch.setattr(preflight.os, "access", lambda p, mode: False if str(p) == str(records)
                        else real(p, mode))
    with pytest.raises(ValueError, match="cannot replace .*metrics.jsonl: it is read-only"):
        preflight.check_writable(str(run))
    assert (run / "config.toml").read_text() == config
