"""Atomic, self-verifying HDF5 checkpoints. No pickle, ever.

File layout (``run_dir/checkpoints/step_00001234.h5``)::

    /model/<param name>     one dataset per state_dict entry (bit-exact, dtype kept)
    /optim/...              the optimiser state_dict, encoded generically (h5state)
    /rng/...                torch CPU RNG state (uint8 dataset), numpy and python states (JSON)
    attrs: format, format_version, created, meta (JSON string), step, epoch,
           digest_algorithm ("sha256"), digests (JSON string {name: hex digest}),
           complete (written LAST)

Every group is written with the generic, bit-exact encoding of :mod:`deepfusion.engine.h5state`.

Integrity (format version 2): ``digests`` holds the sha256 of the dtype, shape and bytes of every
dataset (keyed by its absolute name, e.g. ``/model/0.weight``) and of the ``meta`` text (key
``@meta``), hashed from the arrays in memory as they are written; it is written before
``complete``. :func:`load_checkpoint` hashes each dataset as it reads it, before decoding it, and
refuses a file whose bytes changed after it was written (a bit flip on disk, a bad copy), even
one of unchanged size, naming the first dataset that differs. Version 1 files (no digests)
still load, unverified. :func:`latest_checkpoint`, :func:`prune_checkpoints` and the hint
naming an earlier checkpoint look at the ``complete`` marker only (cheap: no data read);
:func:`load_latest` verifies, and skips corrupt files.

Atomicity (:mod:`deepfusion.engine.atomic`): the file is written to ``<path>.tmp.<pid>``, closed,
fsync'ed and ``os.replace``'d onto ``path``, then the directory is fsync'ed. A file without
``complete`` (a job killed mid-write on a filesystem without atomic rename) is refused by
:func:`load_checkpoint` and skipped by :func:`latest_checkpoint`. Temp files of killed writers
are removed by :func:`prune_checkpoints` (which the trainer calls after every save).

Pure Python/torch/h5py: no PDE, no model, no MPI here (the caller decides which rank saves).
"""
from __future__ import annotations

import json
import os
import random
import re
import time

import h5py
import numpy as np
import torch

from .atomic import atomic_path, remove_stale_temps
from .h5state import (DIGEST_ALGORITHM, CheckpointError, attr_str, digest, json_dumps, read_item,
                      write_dict)

FORMAT = "deepfusion-checkpoint"
FORMAT_VERSION = 2  # 2: per-dataset digests. Version 1 (no digests) is still read.
_STEP_FILE = re.compile(r"^step_(\d+)\.h5$")
_META = "@meta"  # the digest key of the meta attribute (dataset names start with "/")


# ---------------------------------------------------------------------------------------------
# paths
# ---------------------------------------------------------------------------------------------

def checkpoint_dir(run_dir) -> str:
    return os.path.join(os.fspath(run_dir), "checkpoints")


def checkpoint_path(run_dir, step: int) -> str:
    """``run_dir/checkpoints/step_00001234.h5``."""
    step = int(step)
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return os.path.join(checkpoint_dir(run_dir), f"step_{step:08d}.h5")


def _step_files(run_dir) -> list[tuple[int, str]]:
    """(step, path) of every ``step_*.h5`` (temp files excluded), newest first."""
    d = checkpoint_dir(run_dir)
    try:
        names = os.listdir(d)
    except OSError:
        return []
    found = []
    for name in names:
        m = _STEP_FILE.match(name)
        if m:
            found.append((int(m.group(1)), os.path.join(d, name)))
    found.sort(reverse=True)
    return found


def _open(path, mode):
    # No HDF5 file locking: it fails on many cluster filesystems (NFS, Lustre) and is not needed
    # (one rank writes, to a private temp name).
    try:
        return h5py.File(path, mode, locking=False)
    except TypeError:  # pragma: no cover - very old h5py
        return h5py.File(path, mode)


def _is_complete(path) -> bool:
    try:
        with _open(path, "r") as f:
            return bool(f.attrs.get("complete", False)) and f.attrs.get("format") == FORMAT
    except Exception:
        return False


def load_latest(run_dir) -> tuple[str, dict, list[str]]:
    """(path, state, skipped) of the newest checkpoint in ``run_dir`` that loads: newer files
    that are incomplete or corrupt are skipped, each with a one-line reason in ``skipped``.
    Raises :class:`CheckpointError` naming every file tried when none loads."""
    skipped = []
    for _, path in _step_files(run_dir):
        try:
            return path, load_checkpoint(path), skipped
        except CheckpointError as exc:
            skipped.append(f"{os.path.basename(path)}: {exc}")
    where = checkpoint_dir(run_dir)
    tried = "; ".join(skipped) if skipped else "there is none"
    raise CheckpointError(f"no loadable checkpoint in {where} ({tried})")


def latest_checkpoint(run_dir) -> str | None:
    """The newest complete checkpoint in ``run_dir/checkpoints/`` (temp, incomplete and
    unreadable files are skipped silently), or ``None``.

    Cheap: it checks the ``complete`` marker only, not the digests, so a file whose bytes were
    damaged later can still be returned (:func:`load_checkpoint` will refuse it). To get the
    newest checkpoint that actually loads, use :func:`load_latest`."""
    for _, path in _step_files(run_dir):
        if _is_complete(path):
            return path
    return None


def prune_checkpoints(run_dir, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints; incomplete or corrupt step files
    older than the oldest kept one are removed too, and so are the temp files of writers that
    were killed (:func:`~deepfusion.engine.atomic.remove_stale_temps`: the temp file of a live
    process, e.g. a save in progress, is left alone). Returns the removed paths."""
    keep = int(keep)
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    kept = 0
    removed = remove_stale_temps(checkpoint_dir(run_dir), base=_STEP_FILE)
    for _, path in _step_files(run_dir):
        if kept < keep:
            if _is_complete(path):
                kept += 1
            continue  # an unreadable file newer than the kept ones: leave it for inspection
        try:
            os.remove(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


# ---------------------------------------------------------------------------------------------
# save / load
# ---------------------------------------------------------------------------------------------

def _check_states(model_state, optim_state, rng_state, meta) -> None:
    if not isinstance(model_state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model_state.items()):
        raise CheckpointError("model_state must be a dict of str -> Tensor (a module's "
                              "state_dict())")
    for name, value in (("optim_state", optim_state), ("rng_state", rng_state), ("meta", meta)):
        if not isinstance(value, dict):
            raise CheckpointError(f"{name} must be a dict, got {type(value).__name__}")


def _write(f, model_state, optim_state, rng_state, meta, meta_json) -> None:
    f.attrs["format"] = FORMAT
    f.attrs["format_version"] = FORMAT_VERSION
    f.attrs["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    f.attrs["meta"] = meta_json
    digests = {_META: digest(meta_json)}
    for key in ("step", "epoch"):  # handy for h5dump / h5ls; meta is the source
        if type(meta.get(key)) is int:
            f.attrs[key] = meta[key]
    write_dict(f.create_group("model"), model_state, digests)
    write_dict(f.create_group("optim"), optim_state, digests)
    write_dict(f.create_group("rng"), rng_state, digests)
    f.attrs["digest_algorithm"] = DIGEST_ALGORITHM
    f.attrs["digests"] = json.dumps(digests)  # a variable-length string: no 64 KiB header limit
    f.attrs["complete"] = True  # LAST: marks the file as fully written


def save_checkpoint(path, *, model_state: dict, optim_state: dict, rng_state: dict,
                    meta: dict) -> None:
    """Write a checkpoint atomically to ``path`` (see the module docstring for the layout).

    ``meta`` must be JSON-serialisable (step, epoch, config dict, generator/problem names and
    kwargs, world size, ...); it is stored as one JSON string attribute.
    """
    path = os.fspath(path)
    _check_states(model_state, optim_state, rng_state, meta)
    meta_json = json_dumps(meta, "checkpoint meta")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_path(path) as tmp:
        with _open(tmp, "w") as f:
            _write(f, model_state, optim_state, rng_state, meta, meta_json)


def _alternative(path: str) -> str:
    """A hint naming an earlier usable checkpoint next to ``path``."""
    path = os.path.abspath(path)
    d = os.path.dirname(path)
    if os.path.basename(d) == "checkpoints":
        for _, other in _step_files(os.path.dirname(d)):
            if os.path.abspath(other) != path and _is_complete(other):
                return f"use an earlier one: {other}"
    return f"no other complete checkpoint found in {d}"


def _check_header(f, path: str) -> int:
    """The format version, once the file is known to be a complete DeepFusion checkpoint."""
    if f.attrs.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a DeepFusion checkpoint (no format='{FORMAT}' "
                              f"attribute)")
    version = int(f.attrs.get("format_version", 0))
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{path} has checkpoint format version {version}; this "
                              f"DeepFusion reads up to {FORMAT_VERSION}: upgrade it")
    if not bool(f.attrs.get("complete", False)):
        raise CheckpointError(f"incomplete checkpoint {path} (written while the job was "
                              f"killed?); {_alternative(path)}")
    return version


def _recorded_digests(f, version: int) -> dict | None:
    """The digests written with the file (None for version 1, which had none)."""
    if version < 2:
        return None  # written before checkpoints carried digests: read unverified
    if "digests" not in f.attrs:
        raise CheckpointError(f"format version {version} but no 'digests' attribute")
    algorithm = attr_str(f, "digest_algorithm")
    if algorithm != DIGEST_ALGORITHM:
        raise CheckpointError(f"digests made with {algorithm!r}; this DeepFusion knows "
                              f"{DIGEST_ALGORITHM!r}: upgrade it")
    recorded = json.loads(attr_str(f, "digests"))
    if not isinstance(recorded, dict):
        raise CheckpointError("the 'digests' attribute is not a JSON object")
    return recorded


def _read_states(f, version: int) -> dict:
    """Decode the three groups, verifying every dataset against its recorded digest."""
    digests = _recorded_digests(f, version)
    meta = attr_str(f, "meta")
    if digests is not None and digests.pop(_META, None) != digest(meta):
        raise CheckpointError("the 'meta' attribute does not match its recorded digest")
    state = {"model_state": read_item(f["model"], digests),
             "optim_state": read_item(f["optim"], digests),
             "rng_state": read_item(f["rng"], digests),
             "meta": json.loads(meta)}
    if digests:  # recorded, never read: the structure itself was damaged
        raise CheckpointError(f"dataset {next(iter(digests))} is missing")
    return state


def load_checkpoint(path) -> dict:
    """Read a checkpoint: ``{"model_state", "optim_state", "rng_state", "meta"}``.

    Raises :class:`CheckpointError` with a clear message if the file is missing, not HDF5,
    truncated, incomplete (no ``complete`` marker), damaged after it was written (a dataset
    whose digest differs) or otherwise unreadable.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        f = _open(path, "r")
    except Exception as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: not a valid HDF5 file "
                              f"(truncated or corrupt?): {exc}; {_alternative(path)}") from None
    with f:
        version = _check_header(f, path)
        try:
            return _read_states(f, version)
        except Exception as exc:  # h5py, JSON or decoding errors of damaged data, digests
            why = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
            raise CheckpointError(f"corrupt checkpoint {path}: {why}; "
                                  f"{_alternative(path)}") from None


# ---------------------------------------------------------------------------------------------
# RNG helpers
# ---------------------------------------------------------------------------------------------

def capture_rng_state(np_generator: np.random.Generator | None = None) -> dict:
    """The torch CPU, numpy and python ``random`` states, ready for ``save_checkpoint``.

    ``np_generator``: a ``numpy.random.Generator`` whose bit-generator state is captured (a
    JSON-able dict); without it the legacy global ``numpy.random`` state is captured.
    """
    return {
        "torch": torch.get_rng_state(),
        "numpy": (np_generator.bit_generator.state if np_generator is not None
                  else np.random.get_state()),
        "python": random.getstate(),
    }


def restore_rng_state(state: dict, np_generator: np.random.Generator | None = None) -> None:
    """Inverse of :func:`capture_rng_state` (missing entries are left alone)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        if np_generator is not None:
            np_generator.bit_generator.state = state["numpy"]
        else:
            np.random.set_state(tuple(state["numpy"]))
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))


__all__ = [
    "CheckpointError", "capture_rng_state", "checkpoint_path", "latest_checkpoint", "load_latest",
    "load_checkpoint", "prune_checkpoints", "restore_rng_state", "save_checkpoint",
]
