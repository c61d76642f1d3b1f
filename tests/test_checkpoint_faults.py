"""Damaged checkpoints are refused before HDF5 parses them: a seeded bit-flip sweep over a whole
checkpoint (metadata, data, seal), a flipped key name, a missing seal, truncated and empty files,
an earlier DeepFusion's unsealed files (read in a contained check), the fall-back of resume
(real ``mpiexec -n 2``) and infer, and pruning that keeps the good checkpoint."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import h5py
import pytest

from deepfusion.engine.checkpoint import contained
from deepfusion.engine.checkpoint import store as ckpt
from deepfusion.engine.checkpoint.sealed import ChildFailed, run_contained
from tests.faults.bitflip import BAD, PREVIOUS, STEP, fingerprint
from tests.faults.commands import train_args
from tests.faults.files import flip_bit, make_unsealed, raw_ranges, unseal
from tests.in_process import deepfusion_here
from tests.mpi_util import HANG_GUARD, ROOT, deepfusion


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny one-process run with checkpoints at steps 5 and 10 (never modified: copy it),
    trained in this process."""
    d = str(tmp_path_factory.mktemp("faults") / "run")
    p = deepfusion_here(train_args(d))
    assert p.returncode == 0, p.stderr
    assert sorted(os.listdir(ckpt.checkpoint_dir(d))) == [PREVIOUS, STEP]
    return d


def copy_run(run, tmp_path, name="copy") -> str:
    return shutil.copytree(run, tmp_path / name)


def newest(d) -> str:
    return os.path.join(ckpt.checkpoint_dir(d), STEP)


def metadata_bit(path, text: bytes) -> int:
    """A bit inside the first occurrence of ``text`` in the file, checked to lie outside every
    dataset's raw data (a name or an attribute: HDF5 metadata)."""
    data = open(path, "rb").read()
    at = data.index(text) + 1
    assert not any(o <= at < o + n for o, n, _ in raw_ranges(path)), text
    return at * 8 + 1


def sweep(run, tmp_path, *args, expect: int = 0) -> dict:
    """The report of ``python -m tests.faults.bitflip --run RUN ARGS``, which exits ``expect``
    (1: some flip was silent, unclear, crashed or hung)."""
    out = tmp_path / "sweep.json"
    p = subprocess.run([sys.executable, "-m", "tests.faults.bitflip", "--run", run, *args,
                        "--out", str(out)], capture_output=True, text=True, timeout=HANG_GUARD,
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == expect, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.full
def test_the_sweep_refuses_every_flip(run, tmp_path):
    """A few hundred seeded flips over the whole file and every bit of the seal: all refused
    or harmless; none silent, unclear, crashed or hung; none after HDF5 parsed the damaged bytes
    or in a child; one flip through the real infer and resume: both fall back to step 5, saying
    why."""
    report = sweep(run, tmp_path, "--flips", "300", "--seed", "7", "--seal-bits", "--cli", "1")
    totals = report["totals"]
    # 300 seeded flips and every bit of the seal, a seeded flip that fell in the seal once
    assert report["flips"] == 300 + 92 * 8 - report["seeded_in_seal"]
    assert totals["refused"] + totals["harmless"] == report["flips"]
    assert not any(totals[o] for o in BAD)
    regions = report["by_region"]
    assert sum(regions["metadata"].values()) > 50 and sum(regions["data"].values()) > 50
    assert regions["seal"]["refused"] >= 92 * 8
    assert report["refused_after_hdf5_parsed_in_loader"] == 0 and report["contained_checks"] == 0
    assert report["cli"] and all(v == "fell back, saying why" for case in report["cli"]
                                 for k, v in case.items() if k != "bit")


def test_a_flipped_key_name_is_refused(run, tmp_path):
    """A name the per-dataset digests did not cover (an optimiser key in the structure) is
    refused by the seal; in an unsealed file, the structure check refuses it."""
    path = str(tmp_path / "c.h5")
    shutil.copyfile(newest(run), path)
    bit = metadata_bit(path, b"exp_avg_sq")
    flip_bit(path, bit)
    with pytest.raises(ckpt.CheckpointError, match="do not match the whole-file digest"):
        ckpt.load_checkpoint(path)
    shutil.copyfile(newest(run), path)
    make_unsealed(path)
    bit = metadata_bit(path, b'"exp_avg_sq"')  # the key list of an Adam state's dict
    flip_bit(path, bit)
    with pytest.raises(ckpt.CheckpointError, match="keys, member names and members disagree"):
        ckpt.load_checkpoint(path)


def test_a_damaged_list_length_is_refused_not_followed(run, tmp_path):
    """A list's stored length grown by 2**62 (one flipped bit in an unsealed file) is refused
    by the structure check; a reader that named 0..n-1 first would grow until it was killed."""
    path = str(tmp_path / "c.h5")
    shutil.copyfile(newest(run), path)
    make_unsealed(path)
    with h5py.File(path, "r+") as f:
        lists = []
        f.visititems(lambda name, obj: lists.append(obj) if "__len__" in obj.attrs else None)
        lists[0].attrs["__len__"] = int(lists[0].attrs["__len__"]) + 2 ** 62
    with pytest.raises(ckpt.CheckpointError, match="its length and members disagree"):
        ckpt.load_checkpoint(path)


@pytest.mark.full
def test_a_missing_seal_is_refused_and_skipped(run, tmp_path):
    d = copy_run(run, tmp_path)
    unseal(newest(d))
    with pytest.raises(ckpt.CheckpointError, match=r"incomplete or damaged checkpoint .*"
                                                   r"does not end with the whole-file digest"):
        ckpt.load_checkpoint(newest(d))
    found, skipped = ckpt.find_checkpoint(d)
    assert found.endswith(PREVIOUS) and len(skipped) == 1 and skipped[0].startswith(STEP)
    assert ckpt.latest_checkpoint(d) == found


def test_truncated_and_empty_files_are_refused(run, tmp_path):
    path = str(tmp_path / "c.h5")
    data = open(newest(run), "rb").read()
    for cut in (len(data) // 2, len(data) - 1):
        open(path, "wb").write(data[:cut])
        with pytest.raises(ckpt.CheckpointError, match="truncated or corrupt|incomplete or "
                                                       "damaged"):
            ckpt.load_checkpoint(path)
    open(path, "wb").close()
    calls = []
    with pytest.MonkeyPatch.context() as mp:  # refused from its first bytes: no child needed
        mp.setattr(ckpt, "run_contained", lambda *a: calls.append(a))
        with pytest.raises(ckpt.CheckpointError, match="not a valid HDF5 file .*an empty file"):
            ckpt.load_checkpoint(path)
    assert calls == []


def test_an_earlier_unsealed_checkpoint_loads_with_a_note(run, tmp_path, monkeypatch):
    """Accepted, after a contained check (one child for find and load together), with a note;
    its state is the sealed file's."""
    d = copy_run(run, tmp_path)
    expected = ckpt.load_checkpoint(newest(d))
    make_unsealed(newest(d), version=2)
    assert ckpt.seal_status(newest(d)) == "unsealed"
    children = []
    real = ckpt.run_contained
    monkeypatch.setattr(ckpt, "run_contained", lambda *a: children.append(a) or real(*a))
    notes = []
    assert ckpt.find_checkpoint(d, notes)[0] == newest(d)
    got = ckpt.load_checkpoint(newest(d), notes)
    assert fingerprint(got) == fingerprint(expected)
    assert len(children) == 1 and len(notes) == 2
    assert "no whole-file digest (written by an earlier DeepFusion)" in notes[1]


def test_the_contained_check_ends_hangs_and_crashes(run, tmp_path, monkeypatch):
    with pytest.raises(ChildFailed, match=r"did not finish within 1 s"):
        run_contained(["-c", "import time; time.sleep(60)"], 1)
    with pytest.raises(ChildFailed, match="crashed the reader .*SIGSEGV"):
        run_contained(["-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"], 60)
    d = copy_run(run, tmp_path)
    make_unsealed(newest(d))
    monkeypatch.setattr(ckpt, "_PASSED", set())  # these bytes may have passed a check before
    monkeypatch.setattr(contained, "SECONDS", 1.0)
    monkeypatch.setattr(ckpt, "run_contained",  # a reader stuck in a loop on this file
                        lambda args, timeout: run_contained(["-c", "while True: pass"], timeout))
    with pytest.raises(ckpt.CheckpointError, match=rf"corrupt checkpoint .*{STEP}: reading it "
                                                   rf"did not finish .*use an earlier one: "
                                                   rf".*{PREVIOUS}"):
        ckpt.load_checkpoint(newest(d))
    assert ckpt.find_checkpoint(d)[0].endswith(PREVIOUS)


def test_a_crash_before_the_seal_leaves_no_checkpoint(run, tmp_path, monkeypatch):
    d = copy_run(run, tmp_path)
    path = ckpt.checkpoint_path(d, 15)
    state = ckpt.load_checkpoint(newest(d))

    def killed(tmp):
        raise KeyboardInterrupt("killed between writing and sealing")

    monkeypatch.setattr(ckpt, "seal", killed)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(path, **state)
    assert sorted(os.listdir(ckpt.checkpoint_dir(d))) == [PREVIOUS, STEP]


def test_prune_keeps_the_good_checkpoint(run, tmp_path):
    """A damaged newer file (complete marker and all) and an unsealed one never count as kept:
    the good older checkpoint stays."""
    d = copy_run(run, tmp_path)
    offset, size, _ = raw_ranges(newest(d))[-1]
    flip_bit(newest(d), (offset + size // 2) * 8)
    with h5py.File(newest(d), "r") as f:  # still "complete" inside: only the seal can tell
        assert f.attrs["complete"]
    removed = ckpt.prune_checkpoints(d, keep=1)
    assert removed == [] and sorted(os.listdir(ckpt.checkpoint_dir(d))) == [PREVIOUS, STEP]
    newer = ckpt.checkpoint_path(d, 12)
    shutil.copyfile(ckpt.checkpoint_path(d, 5), newer)
    make_unsealed(newer)
    assert ckpt.prune_checkpoints(d, keep=1) == []
    shutil.copyfile(ckpt.checkpoint_path(d, 5), ckpt.checkpoint_path(d, 14))
    ckpt.prune_checkpoints(d, keep=1)  # a sealed, intact newer one: the older ones go
    assert os.listdir(ckpt.checkpoint_dir(d)) == ["step_00000014.h5"]


def test_infer_names_the_checkpoint_it_used(run, tmp_path, cli):
    d = copy_run(run, tmp_path)
    out = tmp_path / "p.h5"
    # --no-check: the answer check's own warning (an untrained model) is not the subject here
    args = ["infer", str(d), "--samples", "2", "--no-check", "--out", str(out)]
    rc, _, err = cli(args)
    assert rc == 0 and f"deepfusion: note: {d}: using its newest checkpoint, {STEP}" in err, err
    flip_bit(newest(d), metadata_bit(newest(d), b"exp_avg_sq"))
    rc, _, err = cli(args)
    lines = [line for line in err.splitlines() if "WARNING" in line]
    assert rc == 0 and len(lines) == 1, err
    assert f"{d}: using {PREVIOUS}" in lines[0] and f"skipped the newer {STEP}" in lines[0]
    assert "whole-file digest" in lines[0]
    with h5py.File(out, "r") as f:
        assert f.attrs["source"].endswith(PREVIOUS)
    os.remove(ckpt.checkpoint_path(d, 5))
    rc, _, err = cli(args)
    assert rc == 2 and f"no complete checkpoint in {d}" in err and STEP in err, err
    assert "Traceback" not in err


@pytest.mark.mpi
def test_resume_falls_back_on_a_metadata_flip(run, tmp_path):
    """The issue's case: a flipped name in the newest checkpoint. Two ranks resume from the
    previous checkpoint with one warning, and metrics.jsonl holds one trajectory."""
    d = str(copy_run(run, tmp_path))
    flip_bit(newest(d), metadata_bit(newest(d), b"exp_avg_sq"))
    p = deepfusion(2, ["train", "--resume", d, "--set", "train.max_steps=12"])
    assert p.returncode == 0, p.stderr
    warnings = [line for line in p.stderr.splitlines() if "skipped checkpoint" in line]
    assert len(warnings) == 1, p.stderr  # on every rank's behalf, once
    assert STEP in warnings[0] and f"using {PREVIOUS}" in warnings[0]
    assert "whole-file digest" in warnings[0]
    assert f"resumed from {os.path.join(d, 'checkpoints', PREVIOUS)} at step 5" in p.stdout
    with open(os.path.join(d, "metrics.jsonl")) as f:
        steps = [r["step"] for r in map(json.loads, f) if r["kind"] == "step"]
    assert steps == list(range(1, 13))


def test_resume_from_an_unsealed_checkpoint_warns_once(run, tmp_path, cli):
    d = str(copy_run(run, tmp_path))
    make_unsealed(newest(d))
    rc, out, err = cli(["train", "--resume", d, "--set", "train.max_steps=12"])
    assert rc == 0, err
    notes = [line for line in err.splitlines() if "no whole-file digest" in line]
    assert len(notes) == 1 and STEP in notes[0], err
    assert f"resumed from {newest(d)} at step 10" in out
    assert ckpt.seal_status(ckpt.checkpoint_path(d, 12)) == "sealed"
