"""Failures that cannot lose a run: a checkpoint damaged on disk is refused by its seal (resume
falls back to the previous one, infer exits 2), temp files of killed writers are cleaned up, and the atomic
write helper publishes whole files or nothing."""
import json
import math
import os
import shutil
import subprocess
import sys

import h5py
import pytest

from deepfusion.engine.checkpoint import atomic
from deepfusion.engine.checkpoint.store import checkpoint_dir, checkpoint_path, prune_checkpoints
from tests.mpi_util import deepfusion
from tests.tiny_configs import TINY


def dead_pid() -> int:
    """The PID of a process that has exited (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def largest_weight(path) -> str:
    """The name of the model dataset with the most bytes (a weight, not a bias)."""
    with h5py.File(path, "r") as f:
        sizes = {ds.name: ds.id.get_storage_size() for ds in f["model"].values()}
    return max(sizes, key=sizes.get)


def overwrite_middle(path, name: str, data: bytes) -> None:
    """Overwrite bytes in the middle of dataset ``name``'s data in place (same file size)."""
    with h5py.File(path, "r") as f:
        ds = f[name]
        offset, size = ds.id.get_offset(), ds.id.get_storage_size()
    assert offset is not None and size > 2 * len(data), name  # contiguous, big enough
    before = os.path.getsize(path)
    with open(path, "r+b") as fh:
        fh.seek(offset + size // 2 - len(data) // 2)
        fh.write(data)
    assert os.path.getsize(path) == before


@pytest.fixture(scope="module")
def corrupt_run(tmp_path_factory):
    """A tiny run with checkpoints at steps 5 and 10; 16 bytes of a weight in step 10 are
    overwritten (NaN patterns, as a disk error might leave them) and a killed save's temp file
    lies next to them. Returns (run dir, corrupt file, corrupt dataset, stale temp file, a copy
    of the checkpoints directory: the resumed run rewrites step 10)."""
    d = tmp_path_factory.mktemp("integrity")
    cfg, run = d / "tiny.toml", str(d / "run")
    cfg.write_text(TINY)
    p = deepfusion(2, ["train", str(cfg)] + [a for s in (
        f"run.dir={run}", "train.checkpoint_every=5", "train.keep_checkpoints=3",
        "train.max_steps=10") for a in ("--set", s)])
    assert p.returncode == 0, p.stderr
    assert sorted(os.listdir(checkpoint_dir(run))) == ["step_00000005.h5", "step_00000010.h5"]
    bad = checkpoint_path(run, 10)
    name = largest_weight(bad)
    overwrite_middle(bad, name, b"\xff" * 16)
    stale = checkpoint_path(run, 11) + f".tmp.{dead_pid()}"
    with open(stale, "wb") as fh:
        fh.write(b"\x89HDF half a checkpoint")
    copy = shutil.copytree(checkpoint_dir(run), d / "copy" / "checkpoints")
    return run, bad, name, stale, str(copy)


@pytest.mark.mpi
def test_resume_skips_the_corrupt_checkpoint(corrupt_run):
    run, _, _, stale, _ = corrupt_run
    p = deepfusion(2, ["train", "--resume", run, "--set", "train.max_steps=15"])
    assert p.returncode == 0, p.stderr
    warnings = [line for line in p.stderr.splitlines() if "skipped checkpoint" in line]
    assert len(warnings) == 1, p.stderr  # rank 0 only, once
    assert "step_00000010.h5" in warnings[0] and "whole-file digest" in warnings[0]
    assert "using step_00000005.h5" in warnings[0]
    assert "resumed from" in p.stdout and "step_00000005" in p.stdout
    with open(os.path.join(run, "metrics.jsonl")) as f:
        steps = [r for r in map(json.loads, f) if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 16))
    assert all(math.isfinite(r["loss"]) for r in steps)
    assert not os.path.exists(stale)  # removed when the step 15 checkpoint was pruned


@pytest.mark.mpi
def test_infer_refuses_the_corrupt_checkpoint(corrupt_run, tmp_path):
    *_, copy = corrupt_run
    bad = os.path.join(copy, "step_00000010.h5")
    out = tmp_path / "preds.h5"
    p = deepfusion(2, ["infer", bad, "--samples", "2", "--out", str(out)])
    assert p.returncode == 2, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, p.stderr
    assert bad in lines[0] and "whole-file digest" in lines[0] and "step_00000005.h5" in lines[0]
    assert "Traceback" not in p.stderr
    assert os.listdir(tmp_path) == []  # no output, no temp file


# ---------------------------------------------------------------------------------------------
# temp files and the atomic helper (in process)
# ---------------------------------------------------------------------------------------------

def test_prune_removes_only_stale_temp_files(tmp_path):
    d = checkpoint_dir(tmp_path)
    os.makedirs(d)
    dead = dead_pid()
    names = {"stale": f"step_00000007.h5.tmp.{dead}",
             "mine": f"step_00000008.h5.tmp.{os.getpid()}",  # a save of this process
             "live": "step_00000009.h5.tmp.1",  # PID 1 always exists
             "other": f"notes.txt.tmp.{dead}"}  # not a checkpoint's temp file
    for name in names.values():
        open(os.path.join(d, name), "wb").close()
    removed = prune_checkpoints(tmp_path, keep=1)
    assert removed == [os.path.join(d, names["stale"])]
    assert sorted(os.listdir(d)) == sorted(v for k, v in names.items() if k != "stale")


def test_pid_alive():
    assert atomic.pid_alive(os.getpid()) and atomic.pid_alive(1)
    assert not atomic.pid_alive(dead_pid())
    assert not atomic.pid_alive(0) and not atomic.pid_alive(-1)  # process groups, not writers
    assert not atomic.pid_alive(2 ** 70)


def test_atomic_path_publishes_whole_files_or_nothing(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="mid-write"):
        with atomic.atomic_path(target) as tmp:
            assert tmp == f"{target}.tmp.{os.getpid()}"
            with open(tmp, "wb") as fh:
                fh.write(b"half")
            raise RuntimeError("mid-write")
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["out.bin"]
    with atomic.atomic_path(target) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(b"new")
    assert target.read_bytes() == b"new" and os.listdir(tmp_path) == ["out.bin"]


def test_failed_publish_removes_the_temp_file(tmp_path):
    target = tmp_path / "taken"
    target.mkdir()  # os.replace of a file onto a directory fails
    with pytest.raises(OSError):
        with atomic.atomic_path(target) as tmp:
            with open(tmp, "wb") as fh:
                fh.write(b"data")
    assert os.listdir(tmp_path) == ["taken"]
