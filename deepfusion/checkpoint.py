"""Atomic HDF5 checkpoints. No pickle, ever.

File layout (``run_dir/checkpoints/step_00001234.h5``)::

    /model/<param name>     one dataset per state_dict entry (bit-exact, dtype kept)
    /optim/...              the optimiser state_dict, encoded generically (below)
    /rng/...                torch CPU RNG state (uint8 dataset), numpy and python states (JSON)
    attrs: format, format_version, meta (JSON string), step, epoch, complete (written LAST)

Generic encoding of Python objects (enough for the Adam, SGD and LBFGS state_dicts of torch):

    tensor            dataset, attrs __type__="tensor", torch_dtype (bfloat16 stored as int16 bits)
    numpy array       dataset, __type__="ndarray";  numpy scalar: __type__="npscalar"
    plain JSON value  (None/bool/int/float/str, lists and str-keyed dicts of those)
                      a UTF-8 string dataset, __type__="json" (tuple of such: "json_tuple")
    dict              group, __type__="dict", __keys__ = JSON list of the keys (int keys stay
                      int, order kept), __names__ = JSON list of the member names
    list / tuple      group, __type__="list"/"tuple", members "0", "1", ...

so an int stays an int, a float a float, None stays None, a tuple a tuple, and tensors are
bit-exact. Reading never unpickles: only numeric datasets and JSON text are decoded.

Atomicity: the file is written to ``<path>.tmp.<pid>``, the root attribute ``complete`` is set
last, the file is flushed, fsync'ed and closed, then ``os.replace``'d onto ``path`` and the
directory is fsync'ed. A file without ``complete`` (a job killed mid-write on a filesystem
without atomic rename) is refused by :func:`load_checkpoint` and skipped by
:func:`latest_checkpoint`.

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

FORMAT = "deepfusion-checkpoint"
FORMAT_VERSION = 1
_STEP_FILE = re.compile(r"^step_(\d+)\.h5$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read (missing, corrupt, incomplete)."""


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


def latest_checkpoint(run_dir) -> str | None:
    """The newest complete checkpoint in ``run_dir/checkpoints/`` (temp, incomplete and corrupt
    files are skipped silently), or ``None``."""
    for _, path in _step_files(run_dir):
        if _is_complete(path):
            return path
    return None


def prune_checkpoints(run_dir, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints; incomplete or corrupt step files
    older than the oldest kept one are removed too. Temp files are left alone (a save may be in
    progress). Returns the removed paths."""
    keep = int(keep)
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    kept = 0
    removed = []
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
# generic encoding
# ---------------------------------------------------------------------------------------------

_JSON_SCALARS = (type(None), bool, int, float, str)


def _is_plain_json(obj) -> bool:
    t = type(obj)
    if t in _JSON_SCALARS:
        return True
    if t is list:
        return all(_is_plain_json(v) for v in obj)
    if t is dict:
        return all(type(k) is str and _is_plain_json(v) for k, v in obj.items())
    return False


def _json_dumps(obj, where: str) -> str:
    try:
        return json.dumps(obj, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{where} is not JSON-serialisable: {exc}") from None


def _write_json(parent, name, value, type_name="json"):
    ds = parent.create_dataset(name, data=_json_dumps(value, f"{parent.name}/{name}"),
                               dtype=h5py.string_dtype("utf-8"))
    ds.attrs["__type__"] = type_name


def _write_tensor(parent, name, t: torch.Tensor):
    if t.is_sparse or t.is_quantized or t.layout != torch.strided:
        raise CheckpointError(f"{parent.name}/{name}: only dense strided tensors can be saved")
    t = t.detach().to("cpu")
    memory_format = ""
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        memory_format = "channels_last"
    elif (t.dim() == 5 and not t.is_contiguous()
          and t.is_contiguous(memory_format=torch.channels_last_3d)):
        memory_format = "channels_last_3d"
    t = t.resolve_conj().resolve_neg().contiguous()
    dtype_name = str(t.dtype).replace("torch.", "")
    if t.dtype == torch.bfloat16:
        arr = t.view(torch.int16).numpy()
    else:
        try:
            arr = t.numpy()
        except (TypeError, RuntimeError) as exc:
            raise CheckpointError(f"{parent.name}/{name}: tensors of dtype {t.dtype} cannot be "
                                  f"saved ({exc})") from None
    ds = parent.create_dataset(name, data=arr)
    ds.attrs["__type__"] = "tensor"
    ds.attrs["torch_dtype"] = dtype_name
    if memory_format:
        ds.attrs["memory_format"] = memory_format


def _member_names(keys) -> list[str]:
    names = []
    for i, k in enumerate(keys):
        if type(k) is str and k and k not in (".", "..") and "/" not in k and not k.startswith("#"):
            names.append(k)
        elif type(k) is int:
            names.append(str(k))
        else:
            names.append(f"#{i}")
    if len(set(names)) != len(names):  # e.g. keys 1 and "1": fall back to positions
        names = [f"#{i}" for i in range(len(keys))]
    return names


def _write_dict(group, d: dict):
    keys = list(d.keys())
    for k in keys:
        if type(k) not in (str, int, float, bool, type(None)):
            raise CheckpointError(f"{group.name}: dict key {k!r} of type {type(k).__name__} "
                                  f"cannot be saved (use str or int keys)")
    names = _member_names(keys)
    group.attrs["__type__"] = "dict"
    group.attrs["__keys__"] = _json_dumps(keys, f"{group.name} keys")
    group.attrs["__names__"] = json.dumps(names)
    for k, name in zip(keys, names):
        _write_item(group, name, d[k])


def _write_item(parent, name: str, value):
    if isinstance(value, torch.Tensor):
        _write_tensor(parent, name, value)
    elif isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise CheckpointError(f"{parent.name}/{name}: object arrays cannot be saved")
        ds = parent.create_dataset(name, data=value)
        ds.attrs["__type__"] = "ndarray"
    elif isinstance(value, np.generic):
        if value.dtype.hasobject:
            raise CheckpointError(f"{parent.name}/{name}: object scalars cannot be saved")
        ds = parent.create_dataset(name, data=np.asarray(value))
        ds.attrs["__type__"] = "npscalar"
    elif _is_plain_json(value):
        _write_json(parent, name, value)
    elif type(value) is tuple and all(_is_plain_json(v) for v in value):
        _write_json(parent, name, list(value), "json_tuple")
    elif isinstance(value, dict):
        _write_dict(parent.create_group(name), value)
    elif isinstance(value, (list, tuple)):
        g = parent.create_group(name)
        g.attrs["__type__"] = "tuple" if isinstance(value, tuple) else "list"
        g.attrs["__len__"] = len(value)
        for i, v in enumerate(value):
            _write_item(g, str(i), v)
    else:
        raise CheckpointError(f"{parent.name}/{name}: cannot save a value of type "
                              f"{type(value).__name__} (allowed: tensors, numpy arrays, JSON "
                              f"values, dicts, lists, tuples)")


def _attr_str(obj, name):
    v = obj.attrs[name]
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


def _read_item(obj):
    kind = _attr_str(obj, "__type__")
    if kind == "tensor":
        arr = np.asarray(obj[()])
        dtype = getattr(torch, _attr_str(obj, "torch_dtype"))
        if dtype == torch.bfloat16:
            t = torch.from_numpy(arr.astype(np.int16, copy=False)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(arr)
            if t.dtype != dtype:
                raise CheckpointError(f"{obj.name}: stored as {t.dtype}, expected {dtype}")
        fmt = obj.attrs.get("memory_format", "")
        if fmt == "channels_last":
            t = t.contiguous(memory_format=torch.channels_last)
        elif fmt == "channels_last_3d":
            t = t.contiguous(memory_format=torch.channels_last_3d)
        return t
    if kind == "ndarray":
        return np.asarray(obj[()])
    if kind == "npscalar":
        return np.asarray(obj[()])[()]
    if kind in ("json", "json_tuple"):
        value = json.loads(obj.asstr()[()])
        return tuple(value) if kind == "json_tuple" else value
    if kind == "dict":
        keys = json.loads(_attr_str(obj, "__keys__"))
        names = json.loads(_attr_str(obj, "__names__"))
        return {k: _read_item(obj[n]) for k, n in zip(keys, names)}
    if kind in ("list", "tuple"):
        items = [_read_item(obj[str(i)]) for i in range(int(obj.attrs["__len__"]))]
        return tuple(items) if kind == "tuple" else items
    raise CheckpointError(f"{obj.name}: unknown stored type {kind!r}")


# ---------------------------------------------------------------------------------------------
# save / load
# ---------------------------------------------------------------------------------------------

def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # pragma: no cover - e.g. platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def save_checkpoint(path, *, model_state: dict, optim_state: dict, rng_state: dict,
                    meta: dict) -> None:
    """Write a checkpoint atomically to ``path`` (see the module docstring for the layout).

    ``meta`` must be JSON-serialisable (step, epoch, config dict, generator/problem names and
    kwargs, world size, ...); it is stored as one JSON string attribute.
    """
    path = os.fspath(path)
    if not isinstance(model_state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model_state.items()):
        raise CheckpointError("model_state must be a dict of str -> Tensor (a module's "
                              "state_dict())")
    for name, value in (("optim_state", optim_state), ("rng_state", rng_state), ("meta", meta)):
        if not isinstance(value, dict):
            raise CheckpointError(f"{name} must be a dict, got {type(value).__name__}")
    meta_json = _json_dumps(meta, "checkpoint meta")

    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        f = _open(tmp, "w")
        try:
            f.attrs["format"] = FORMAT
            f.attrs["format_version"] = FORMAT_VERSION
            f.attrs["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            f.attrs["meta"] = meta_json
            for key in ("step", "epoch"):  # handy for h5dump / h5ls; meta is the source
                if type(meta.get(key)) is int:
                    f.attrs[key] = meta[key]
            _write_dict(f.create_group("model"), model_state)
            _write_dict(f.create_group("optim"), optim_state)
            _write_dict(f.create_group("rng"), rng_state)
            f.attrs["complete"] = True  # LAST: marks the file as fully written
            f.flush()
            try:
                os.fsync(f.id.get_vfd_handle())
                synced = True
            except Exception:  # pragma: no cover - non-POSIX driver
                synced = False
        finally:
            f.close()
        if not synced:  # pragma: no cover
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
        _fsync_dir(directory)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def _alternative(path: str) -> str:
    """A hint naming an earlier usable checkpoint next to ``path``."""
    path = os.path.abspath(path)
    d = os.path.dirname(path)
    if os.path.basename(d) == "checkpoints":
        for _, other in _step_files(os.path.dirname(d)):
            if os.path.abspath(other) != path and _is_complete(other):
                return f"use an earlier one: {other}"
    return f"no other complete checkpoint found in {d}"


def load_checkpoint(path) -> dict:
    """Read a checkpoint: ``{"model_state", "optim_state", "rng_state", "meta"}``.

    Raises :class:`CheckpointError` with a clear message if the file is missing, not HDF5,
    truncated, incomplete (no ``complete`` marker) or otherwise unreadable.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        f = _open(path, "r")
    except Exception as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: not a valid HDF5 file "
                              f"(truncated or corrupt?): {exc}; {_alternative(path)}") from None
    try:
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
        try:
            return {
                "model_state": _read_item(f["model"]),
                "optim_state": _read_item(f["optim"]),
                "rng_state": _read_item(f["rng"]),
                "meta": json.loads(_attr_str(f, "meta")),
            }
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"corrupt checkpoint {path}: {type(exc).__name__}: {exc}; "
                                  f"{_alternative(path)}") from None
    finally:
        f.close()


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
    "CheckpointError", "capture_rng_state", "checkpoint_path", "latest_checkpoint",
    "load_checkpoint", "prune_checkpoints", "restore_rng_state", "save_checkpoint",
]
