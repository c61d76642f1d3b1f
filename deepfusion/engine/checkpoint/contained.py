"""The contained check of an unsealed checkpoint: ``python -m deepfusion.engine.checkpoint.contained
FILE`` reads every group, attribute and dataset of FILE with h5py, in a child process, and
prints the verdict as one JSON line (``{"sha256": ...}`` of the bytes it read, or
``{"error": ..., "opened": false | true}``: whether HDF5 could open it at all).

A damaged HDF5 structure can make the library loop or crash; in a child that costs only the
child. The child needs h5py and numpy, not torch, so it starts in well under a second and its
hang guard (:data:`SECONDS`) is seconds, not minutes. What the state means (versions, digests,
the arrays torch loads) is checked by the parent afterwards, on the very bytes the child read.
"""
from __future__ import annotations

import hashlib
import io
import json
import sys

SECONDS = 20.0   # the child's hang guard, plus the time to read the file (PER_BYTE)
PER_BYTE = 1 / 50e6


def visit(_name, obj) -> None:
    """Read one object: its attributes, and its data if it is a dataset."""
    import h5py

    for key in obj.attrs:
        obj.attrs[key]
    if isinstance(obj, h5py.Dataset):
        obj[()]


def verdict(data: bytes) -> dict:
    """Read every object of the HDF5 file in ``data``: its sha256, or the library's error."""
    import h5py

    try:
        f = h5py.File(io.BytesIO(data), "r")
    except Exception as exc:  # whatever the library raises on a file it cannot open
        return {"error": str(exc), "opened": False}
    try:
        with f:
            visit("/", f)
            f.visititems(visit)
    except Exception as exc:  # a damaged structure inside
        return {"error": f"{type(exc).__name__}: {exc}", "opened": True}
    return {"sha256": hashlib.sha256(data).hexdigest()}


def main(argv) -> int:
    with open(argv[0], "rb") as fh:
        print(json.dumps(verdict(fh.read())), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
