"""Per-dataset checkpoint digests: a bit flip in any dataset, or in JSON text that still parses,
is detected on load and named, even where the whole-file seal cannot see it (damage done before
the file was sealed: :func:`tests.faults.files.reseal`); unsealed files an earlier DeepFusion
wrote (version 2, and version 1 without digests) still load, in a contained check first."""
from __future__ import annotations

import json
import re
import shutil

import h5py
import numpy as np
import pytest

from deepfusion.engine.checkpoint.store import (CheckpointError, capture_rng_state, checkpoint_path,
                                         load_checkpoint, save_checkpoint)
from tests.faults.files import make_unsealed, reseal
from tests.test_checkpoint import _assert_same, _make_opt, _model, _step


def _full_checkpoint(path, meta=None):
    """Model, Adam state and all three RNG states: every kind of dataset a run writes."""
    m = _model()
    opt = _make_opt("adam", m.parameters())
    _step(m, opt)
    save_checkpoint(path, model_state=m.state_dict(), optim_state=opt.state_dict(),
                    rng_state=capture_rng_state(np.random.default_rng(0)),
                    meta=meta or {"step": 1})


def _flip_bit(path, offset: int) -> None:
    """Flip a bit of byte ``offset``, then seal the file again: the seal passes, as it would
    for damage done in memory before the file was written, and only the digests can tell."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ 0x10]))
    reseal(path)


def _stored_datasets(path) -> dict:
    """name -> (file offset, bytes, is a string) of every dataset whose data lie in the file."""
    found = {}

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset) and obj.id.get_offset() is not None:
            found[obj.name] = (obj.id.get_offset(), obj.id.get_storage_size(),
                               h5py.check_string_dtype(obj.dtype) is not None)

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return found


def test_a_bit_flip_in_any_dataset_is_detected(tmp_path):
    good, bad = checkpoint_path(tmp_path, 1), checkpoint_path(tmp_path, 2)
    _full_checkpoint(good)
    stored = _stored_datasets(good)
    assert {n.split("/")[1] for n in stored} == {"model", "optim", "rng"}
    for name, (offset, size, is_string) in stored.items():
        shutil.copyfile(good, bad)
        _flip_bit(bad, offset + size // 2)
        # a string dataset's data is a reference to its text in the heap: flipped, it points
        # elsewhere and HDF5 may fail to follow it before a digest can be compared
        why = "cannot be read" if is_string else "does not match its recorded digest"
        with pytest.raises(CheckpointError, match=rf"corrupt checkpoint .*step_00000002\.h5: "
                                                  rf"dataset {re.escape(name)} {why}.*; "
                                                  rf"use an earlier one: "
                                                  rf".*step_00000001\.h5"):
            load_checkpoint(bad)


@pytest.mark.parametrize("text,what", [(b"PCG64", "dataset /rng/numpy"),
                                       (b"marker-42", "the 'meta' attribute")])
def test_a_bit_flip_in_json_text_is_detected(tmp_path, text, what):
    """JSON strings (RNG states, meta) live in HDF5's heap: found by their text."""
    path = tmp_path / "c.h5"
    _full_checkpoint(path, meta={"step": 1, "note": "marker-42"})
    data = open(path, "rb").read()
    assert data.count(text) == 1
    _flip_bit(path, data.index(text) + 1)  # still valid JSON: only the digest can tell
    with pytest.raises(CheckpointError, match=re.escape(what) + ".* does not match its "
                                                                "recorded digest"):
        load_checkpoint(path)


# What a file of an earlier version means by the meta keys it lacks (docs/run-directory.md)
EARLIER = {"optimizer": None, "schedule_steps": None, "visit": 0, "level": 0, "elapsed_s": 0.0,
           "plan": None, "grid": None}


@pytest.mark.full
def test_files_without_digests(tmp_path):
    """Unsealed files: version 2 loads with a note, version 1 (written before digests) loads
    unverified, each with the meta keys it lacks filled; a version 2 file that lost its
    digests is refused (each read in a child first)."""
    path = tmp_path / "old.h5"
    _full_checkpoint(path)
    expected = load_checkpoint(path)
    assert expected["meta"] == {"step": 1}  # the current version: as written
    expected["meta"].update(EARLIER)
    make_unsealed(path, version=2)
    notes = []
    _assert_same(expected, load_checkpoint(path, notes), "version 2")
    assert len(notes) == 1 and "no whole-file digest" in notes[0] and str(path) in notes[0]
    with h5py.File(path, "a") as f:
        del f.attrs["digests"], f.attrs["digest_algorithm"]
    with pytest.raises(CheckpointError, match="format version 2 but no 'digests' attribute"):
        load_checkpoint(path)
    with h5py.File(path, "a") as f:
        f.attrs["format_version"] = 1
    _assert_same(expected, load_checkpoint(path), "version 1")


def test_an_earlier_versions_meta_is_upgraded_on_load(tmp_path):
    """The one upgrade step: a run's checkpoint of an earlier version, without the keys of
    later trainers, loads with the values their absence meant (the grid trained on: the
    problem's); the keys it has are kept."""
    path = tmp_path / "old.h5"
    meta = {"step": 7, "lr_scale": 0.5, "world_size": 2, "config": {"train": {}},
            "model": {"name": "unet", "kwargs": {}},
            "problem": {"name": "poisson", "kwargs": {"grid": [16, 16]}}, "visit": 1}
    _full_checkpoint(path, meta=meta)
    make_unsealed(path, version=2)
    got = load_checkpoint(path)["meta"]
    assert got == {**meta, **EARLIER, "visit": 1, "grid": [16, 16]}
