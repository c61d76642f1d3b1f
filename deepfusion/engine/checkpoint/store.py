"""Atomic, sealed, self-verifying HDF5 checkpoints. No pickle, ever.

File layout (``run_dir/checkpoints/step_00001234.h5``), groups in the bit-exact encoding of
:mod:`deepfusion.engine.checkpoint.h5state`::

    /model/<param name>     one dataset per state_dict entry (bit-exact, dtype kept)
    /optim/...              the optimiser state_dict, encoded generically (h5state)
    /rng/...                torch CPU RNG state (uint8 dataset), numpy and python states (JSON)
    attrs: format, format_version, created, meta (JSON string), step, epoch,
           digest_algorithm ("sha256"), digests (JSON {dataset name: sha256}), complete (LAST)
    then, after the HDF5 end of file, the seal: the sha256 of every byte above it

Integrity (format version 3). Once the HDF5 file is closed, :func:`save_checkpoint` appends
the seal (:mod:`deepfusion.engine.checkpoint.sealed`), the completion mark. :func:`load_checkpoint` reads
the file into memory, checks the seal by hashing alone, and only then lets HDF5 parse those very
bytes: any changed byte (data, structure, a name, the seal) is refused in milliseconds and
nothing damaged is ever parsed, so no damage can make the loader loop or crash. ``digests``
(hashed from the arrays in memory as they were written) are still checked as datasets decode.

Unsealed files: versions 1 (no digests) and 2 (per-dataset digests), an earlier DeepFusion's,
still load, with a note: a child process reads every object of them first with h5py
(:mod:`.contained`, no torch: a hang ends within seconds, a crash ends only the child) and only
the bytes it read are parsed here, then brought to the current layout by the one upgrade step,
:func:`deepfusion.engine.checkpoint.upgrade.upgrade`. A version 3 file without its seal (cut
short, changed) is refused.

:func:`verify_checkpoint` checks a file without loading it, :func:`find_checkpoint` and
:func:`latest_checkpoint` return the newest that passes, :func:`load_latest` the newest that
loads; :func:`prune_checkpoints` counts only sealed, intact files as kept ones.

Atomicity (:mod:`deepfusion.engine.checkpoint.atomic`): written to ``<path>.tmp.<pid>``, closed, sealed,
fsync'ed, ``os.replace``'d onto ``path``, the directory fsync'ed: ``path`` is a whole sealed file
or absent, whenever the job is killed. :func:`prune_checkpoints` (after every save) removes the
temp files of killed writers. No PDE, no model, no MPI here (the caller decides which rank saves).
"""
from __future__ import annotations

import io
import json
import os
import re
import sys
import time
from contextlib import contextmanager
from contextvars import ContextVar

import h5py
import torch

from deepfusion.engine.checkpoint import contained
from deepfusion.engine.checkpoint.atomic import atomic_path, remove_stale_temps
from deepfusion.engine.checkpoint.h5state import (DIGEST_ALGORITHM, CheckpointError, attr_str, digest, json_dumps, read_item,
                      write_dict)
from deepfusion.engine.checkpoint.rngstate import capture_rng_state, restore_rng_state  # re-exported: part of the API
from deepfusion.engine.checkpoint.sealed import (ChildFailed, SealBroken, check_sealed, read_sealed, run_contained, seal,
                     sha256_hex)
from deepfusion.engine.checkpoint.upgrade import upgrade

FORMAT = "deepfusion-checkpoint"
FORMAT_VERSION = 3  # 3: sealed; 2: per-dataset digests; 1: neither. All three are read.
_STEP_FILE = re.compile(r"^step_(\d+)\.h5$")
_META = "@meta"  # the digest key of the meta attribute (dataset names start with "/")
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_PASSED: set[str] = set()  # sha256 of unsealed bytes whose check passed: find, then load, once
_HINTING = ContextVar("hinting", default=False)  # inside _alternative: a candidate's refusal needs no hint


# ---------------------------------------------------------------------------------------------
# paths, checks and choices
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
    """(step, path) of every ``step_*.h5`` in ``run_dir/checkpoints`` (temp files excluded),
    newest first."""
    return _step_files_in(checkpoint_dir(run_dir))


def _step_files_in(d) -> list[tuple[int, str]]:
    """(step, path) of every ``step_*.h5`` in directory ``d``, newest first."""
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


def seal_status(path) -> str:
    """"sealed" (and intact), "unsealed" (not checked further) or "broken": hashing only."""
    try:
        return "sealed" if check_sealed(path) else "unsealed"
    except (SealBroken, OSError):
        return "broken"


def _corrupt(path, why) -> CheckpointError:
    return CheckpointError(f"corrupt checkpoint {path}: {why}; {_alternative(path)}")


@contextmanager
def _reading(path: str):
    """Reading ``path``'s bytes, before any parsing: a missing file, a broken seal and an I/O
    error become the CheckpointError that says which."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        yield
    except SealBroken as exc:
        raise _corrupt(path, exc) from None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from None


def _require_hdf5(path, head: bytes) -> None:
    """Refuse, without parsing, a file that does not even start as HDF5 (empty, overwritten)."""
    if head[:8] != _HDF5_SIGNATURE:
        what = "an empty file" if not head else "no HDF5 signature at its start"
        raise CheckpointError(f"cannot read checkpoint {path}: not a valid HDF5 file "
                              f"(truncated or corrupt?): {what}; {_alternative(path)}")


def _contained_check(path: str, sha: str | None = None) -> None:
    """Read the unsealed file ``path`` in a child process (:mod:`.contained`); CheckpointError
    unless HDF5 reads it there (and, with ``sha``, unless the child read those very bytes)."""
    if not _HINTING.get():   # a candidate for a hint is checked unannounced
        print(f"deepfusion: checking {path} in a separate process first (it has no whole-file "
              f"digest: an earlier DeepFusion wrote it)", file=sys.stderr, flush=True)
    guard = contained.SECONDS + os.path.getsize(path) * contained.PER_BYTE
    try:
        answer = json.loads(run_contained(["-m", contained.__name__, path], guard))
        if not isinstance(answer, dict):
            raise ValueError(f"unexpected answer {answer!r}")
    except (ChildFailed, ValueError) as exc:
        raise _corrupt(path, exc) from None
    if "error" in answer and not answer.get("opened"):
        raise CheckpointError(f"cannot read checkpoint {path}: not a valid HDF5 file (truncated "
                              f"or corrupt?): {answer['error']}; {_alternative(path)}")
    if "error" in answer:
        raise _corrupt(path, answer["error"])
    if sha is not None and answer.get("sha256") != sha:
        raise CheckpointError(f"checkpoint {path} changed while it was being checked: try again")
    _PASSED.add(str(answer.get("sha256")))


def verify_checkpoint(path) -> bool:
    """Check ``path`` without loading it: True if it is sealed and intact (hashing only), False
    if it is unsealed (an earlier DeepFusion's) and loads in a contained check. Raises
    :class:`CheckpointError` saying why it cannot be used."""
    path = os.fspath(path)
    with _reading(path):
        if check_sealed(path):
            return True
        with open(path, "rb") as fh:
            data = fh.read()
        _require_hdf5(path, data[:8])
    _contained_check(path, sha256_hex(data))
    _parse(path, data, sealed=False)   # what the state means: safe to parse once HDF5 read it
    return False


def unsealed_note(path) -> str:
    return (f"{path} has no whole-file digest (written by an earlier DeepFusion): it was read "
            f"in a separate process before it was loaded; checkpoints written from now on have one")


def find_checkpoint(run_dir, notes: list | None = None) -> tuple[str | None, list[str]]:
    """(the newest checkpoint in ``run_dir`` that passes :func:`verify_checkpoint`, or None;
    one line per newer file skipped, saying why). ``notes`` as for :func:`load_checkpoint`."""
    skipped = []
    for _, path in _step_files(run_dir):
        try:
            if not verify_checkpoint(path) and notes is not None:
                notes.append(unsealed_note(path))
            return path, skipped
        except CheckpointError as exc:
            skipped.append(f"{os.path.basename(path)}: {exc}")
    return None, skipped


def latest_checkpoint(run_dir) -> str | None:
    """The newest checkpoint in ``run_dir/checkpoints/`` that passes its check (temp files and
    files that fail are skipped silently: :func:`find_checkpoint` says why), or ``None``."""
    return find_checkpoint(run_dir)[0]


def load_latest(run_dir, notes: list | None = None) -> tuple[str, dict, list[str]]:
    """(path, state, skipped) of the newest checkpoint in ``run_dir`` that loads: newer files
    that are incomplete or corrupt are skipped, each with a one-line reason in ``skipped``
    (``notes``: see :func:`load_checkpoint`). Raises :class:`CheckpointError` naming every file
    tried when none loads."""
    skipped = []
    for _, path in _step_files(run_dir):
        try:
            return path, load_checkpoint(path, notes), skipped
        except CheckpointError as exc:
            skipped.append(f"{os.path.basename(path)}: {exc}")
    where = checkpoint_dir(run_dir)
    tried = "; ".join(skipped) if skipped else "there is none"
    raise CheckpointError(f"no loadable checkpoint in {where} ({tried})")


def prune_checkpoints(run_dir, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` sealed, intact checkpoints (hashing only); other step
    files never count as kept ones and are left alone while newer than the oldest kept one.
    Temp files of killed writers go too (:func:`~deepfusion.engine.checkpoint.atomic.remove_stale_temps`:
    never a live process's, e.g. a save in progress). Returns the removed paths."""
    keep = int(keep)
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    kept = 0
    removed = remove_stale_temps(checkpoint_dir(run_dir), base=_STEP_FILE)
    for _, path in _step_files(run_dir):
        if kept < keep:
            if seal_status(path) == "sealed":
                kept += 1
            continue
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
    f.attrs["complete"] = True  # LAST in the HDF5 file; the seal after it marks the whole file


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
        seal(tmp)  # of the closed file's bytes: published together with them, or not at all


def _alternative(path: str) -> str:
    """A hint naming the newest other checkpoint next to ``path`` that passes
    :func:`verify_checkpoint` (the check a run directory's newest is chosen by), or saying that
    none does: a hint must never send the user to a file that is itself cut short or empty."""
    if _HINTING.get():   # a candidate being verified for a hint: its refusal is not shown
        return "(not the one to use)"
    path = os.path.abspath(path)
    d = os.path.dirname(path)
    m = _STEP_FILE.match(os.path.basename(path))
    step = int(m.group(1)) if m else None
    token = _HINTING.set(True)
    try:
        for other_step, other in _step_files_in(d):
            if os.path.abspath(other) == path:
                continue
            try:
                verify_checkpoint(other)
            except CheckpointError:
                continue
            newer = step is not None and other_step > step
            return f"use {'a newer' if newer else 'an earlier'} one: {other}"
    finally:
        _HINTING.reset(token)
    return f"no other checkpoint in {d} passes its check"


def _check_header(f, path: str, sealed: bool) -> int:
    """The format version, once the file is known to be a complete DeepFusion checkpoint."""
    if f.attrs.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a DeepFusion checkpoint (no format='{FORMAT}' "
                              f"attribute)")
    version = int(f.attrs.get("format_version", 0))
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{path} has checkpoint format version {version}; this "
                              f"DeepFusion reads up to {FORMAT_VERSION}: upgrade it")
    if version >= 3 and not sealed:
        raise CheckpointError(f"incomplete or damaged checkpoint {path}: it does not end with "
                              f"the whole-file digest its format (version {version}) is written "
                              f"with (cut short, or changed after it was written?); "
                              f"{_alternative(path)}")
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


def _parse(path: str, data: bytes, sealed: bool) -> dict:
    """The state in ``data`` (the bytes of ``path``, already checked)."""
    try:
        f = h5py.File(io.BytesIO(data), "r")
    except Exception as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: not a valid HDF5 file "
                              f"(truncated or corrupt?): {exc}; {_alternative(path)}") from None
    with f:
        try:
            version = _check_header(f, path, sealed)  # its messages name the file
        except CheckpointError:
            raise
        except Exception as exc:  # h5py errors of a damaged (unsealed) file's attributes
            raise _corrupt(path, f"{type(exc).__name__}: {exc}") from None
        try:
            return upgrade(_read_states(f, version), version, FORMAT_VERSION)
        except Exception as exc:  # h5py, JSON or decoding errors of damaged data, digests
            why = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
            raise _corrupt(path, why) from None


def load_checkpoint(path, notes: list | None = None) -> dict:
    """Read a checkpoint: ``{"model_state", "optim_state", "rng_state", "meta"}``.

    The bytes are checked against the seal before HDF5 parses them. Raises
    :class:`CheckpointError` with a clear message if the file is missing, not HDF5, truncated,
    incomplete, changed after it was written (any byte) or otherwise unreadable. An unsealed
    file is read in a contained check first, and ``notes`` (a list, if given) gets a line.
    """
    path = os.fspath(path)
    with _reading(path):
        data, sealed = read_sealed(path)
    if not sealed:
        _require_hdf5(path, data[:8])
        sha = sha256_hex(data)
        if sha not in _PASSED:
            _contained_check(path, sha)
        if notes is not None:
            notes.append(unsealed_note(path))
    return _parse(path, data, sealed)


__all__ = [
    "CheckpointError", "capture_rng_state", "checkpoint_path", "find_checkpoint",
    "latest_checkpoint", "load_latest", "load_checkpoint", "prune_checkpoints",
    "restore_rng_state", "save_checkpoint", "seal_status", "unsealed_note", "verify_checkpoint",
]
