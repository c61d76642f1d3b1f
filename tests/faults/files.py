"""Damage a checkpoint file on purpose: flip one bit, strip or redo its seal, turn it into the
unsealed format an earlier DeepFusion wrote, and find where its datasets' raw data lie
(:class:`Regions`: which region a byte is in)."""
from __future__ import annotations

import bisect
import os

import h5py

from deepfusion.engine.checkpoint.sealed import TRAILER_SIZE, recorded_digest, seal


def flip_bit(path, bit: int) -> None:
    """Flip bit ``bit`` of the file (bit 0 is the lowest bit of byte 0), in place."""
    with open(path, "r+b") as fh:
        fh.seek(bit // 8)
        byte = fh.read(1)[0]
        fh.seek(bit // 8)
        fh.write(bytes([byte ^ (1 << (bit % 8))]))


def sealed(path) -> bool:
    with open(path, "rb") as fh:
        fh.seek(max(0, fh.seek(0, 2) - TRAILER_SIZE))
        return recorded_digest(fh.read()) is not None


def unseal(path) -> None:
    """Cut the seal off (as a file cut short by its last 92 bytes would be)."""
    assert sealed(path), path
    with open(path, "r+b") as fh:
        size = fh.seek(0, 2)
        fh.truncate(size - TRAILER_SIZE)


def reseal(path) -> None:
    """Seal the file again as it is now: damage done before the seal was computed."""
    unseal(path)
    seal(path)


def make_unsealed(path, version: int = 2) -> None:
    """The file as an earlier DeepFusion wrote it: no seal, ``format_version`` = ``version``."""
    if sealed(path):
        unseal(path)
    with h5py.File(path, "r+") as f:
        f.attrs["format_version"] = version


def normalised_copy(src, dst) -> None:
    """``src`` saved again as ``dst`` with what differs between two runs of one config set to
    fixed values: the run directory and elapsed time in its meta, the global numpy and Python
    RNG states (seeded by the OS). Their lengths move every structure after them; so fixed, two
    runs give files of one layout (the same bit is the same place in both)."""
    import random

    import numpy as np

    from deepfusion.engine.checkpoint.store import load_checkpoint, save_checkpoint

    state = load_checkpoint(src)
    meta = state["meta"]
    meta["elapsed_s"] = 0.0
    meta.setdefault("config", {}).setdefault("run", {})["dir"] = "runs/tiny"
    state["rng_state"].update(numpy=np.random.RandomState(0).get_state(),
                              python=random.Random(0).getstate())
    save_checkpoint(dst, **state)


def raw_ranges(path) -> list[tuple[int, int, str]]:
    """(offset, size, dataset name) of every dataset whose data lie contiguously in the file
    (h5py's ``get_offset``/``get_storage_size``), by offset. Everything else in the HDF5 part
    (superblock, object headers, B-trees, heaps, attributes, compact data, the text of
    variable-length strings) is metadata."""
    found = []

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset):
            offset = obj.id.get_offset()
            if offset is not None and obj.id.get_storage_size() > 0:
                found.append((offset, obj.id.get_storage_size(), obj.name))

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return sorted(found)


class Regions:
    """The regions of a checkpoint file: the seal (last bytes), raw data, metadata."""

    def __init__(self, path, sealed: bool):
        self.size = os.path.getsize(path)
        self.seal_start = self.size - TRAILER_SIZE if sealed else self.size
        self.ranges = raw_ranges(path)
        self.starts = [o for o, _, _ in self.ranges]

    def of(self, byte: int) -> str:
        if byte >= self.seal_start:
            return "seal"
        i = bisect.bisect_right(self.starts, byte) - 1
        if i >= 0 and byte < self.ranges[i][0] + self.ranges[i][1]:
            return "data"
        return "metadata"

    def sizes(self) -> dict:
        data = sum(n for _, n, _ in self.ranges)
        seal = self.size - self.seal_start
        return {"file": self.size, "metadata": self.size - data - seal, "data": data,
                "seal": seal, "datasets": len(self.ranges)}
