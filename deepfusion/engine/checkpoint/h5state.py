"""Nested state (a torch ``state_dict``, RNG states, ...) to and from an HDF5 group. No pickle.

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

:func:`write_dict` writes a dict into a group, :func:`read_item` reads any encoded member back.

Integrity: given a ``digests`` dict, :func:`write_dict` records the :func:`digest` (sha256 of
dtype, shape and bytes) of every dataset it writes under the dataset's absolute name, hashing the
array in memory (no read-back); :func:`read_item` checks each dataset's bytes against that record
as it reads them, before decoding, and raises :class:`CheckpointError` naming the first dataset
that differs; a dict whose keys, member names and members disagree, or a list whose length and
members disagree, is refused too (the digests cover the data, these the structure around it).
The caller stores the record (:mod:`deepfusion.engine.checkpoint.store`: a root attribute) and
re-exports :class:`CheckpointError`.
"""
from __future__ import annotations

import hashlib
import json

import h5py
import numpy as np
import torch


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read (missing, corrupt, incomplete)."""


DIGEST_ALGORITHM = "sha256"  # hardware-accelerated on current x86 and ARM cores (SHA extensions)


def digest(data) -> str:
    """sha256 of an array's dtype, shape and C-order bytes, or of a string's UTF-8 bytes (a
    scalar string dataset writes ``str`` and reads back ``bytes``: both hash alike)."""
    h = hashlib.sha256()
    if isinstance(data, str):
        data = data.encode("utf-8")
    if isinstance(data, bytes):
        h.update(b"utf8|")
        h.update(data)
    else:
        arr = np.asarray(data)  # a 0-d dataset reads back as a numpy scalar
        h.update(f"{arr.dtype.str}{arr.shape}|".encode())
        h.update(np.ascontiguousarray(arr).view(np.uint8).reshape(-1))
    return h.hexdigest()


def _create(parent, name, data, type_name: str, digests, **kw):
    """A dataset of ``data`` with its ``__type__``; its digest goes into ``digests``."""
    ds = parent.create_dataset(name, data=data, **kw)
    ds.attrs["__type__"] = type_name
    if digests is not None:
        digests[ds.name] = digest(data)
    return ds


def _read(obj, digests):
    """A dataset's stored value, checked against ``digests`` (popping its entry) if given."""
    try:
        raw = obj[()]
    except Exception as exc:  # e.g. a damaged reference to a string in HDF5's heap
        raise CheckpointError(f"dataset {obj.name} cannot be read ({type(exc).__name__}: "
                              f"{exc})") from None
    if digests is not None:
        recorded = digests.pop(obj.name, None)
        if recorded is None:
            raise CheckpointError(f"dataset {obj.name} has no recorded digest")
        if digest(raw) != recorded:
            raise CheckpointError(f"dataset {obj.name} does not match its recorded digest (the "
                                  f"file changed after it was written: disk or copy error?)")
    return raw


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


def json_dumps(obj, where: str) -> str:
    try:
        return json.dumps(obj, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{where} is not JSON-serialisable: {exc}") from None


def _write_json(parent, name, value, digests, type_name="json"):
    _create(parent, name, json_dumps(value, f"{parent.name}/{name}"), type_name, digests,
            dtype=h5py.string_dtype("utf-8"))


def _write_tensor(parent, name, t: torch.Tensor, digests):
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
    ds = _create(parent, name, arr, "tensor", digests)
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


def write_dict(group, d: dict, digests: dict | None = None):
    """Encode ``d`` into ``group``; with ``digests``, record every dataset's :func:`digest`."""
    keys = list(d.keys())
    for k in keys:
        if type(k) not in (str, int, float, bool, type(None)):
            raise CheckpointError(f"{group.name}: dict key {k!r} of type {type(k).__name__} "
                                  f"cannot be saved (use str or int keys)")
    names = _member_names(keys)
    group.attrs["__type__"] = "dict"
    group.attrs["__keys__"] = json_dumps(keys, f"{group.name} keys")
    group.attrs["__names__"] = json.dumps(names)
    for k, name in zip(keys, names):
        _write_item(group, name, d[k], digests)


def _write_item(parent, name: str, value, digests):
    if isinstance(value, torch.Tensor):
        _write_tensor(parent, name, value, digests)
    elif isinstance(value, (np.ndarray, np.generic)):
        if value.dtype.hasobject:
            raise CheckpointError(f"{parent.name}/{name}: object arrays cannot be saved")
        kind = "ndarray" if isinstance(value, np.ndarray) else "npscalar"
        _create(parent, name, np.asarray(value), kind, digests)
    elif _is_plain_json(value):
        _write_json(parent, name, value, digests)
    elif type(value) is tuple and all(_is_plain_json(v) for v in value):
        _write_json(parent, name, list(value), digests, "json_tuple")
    elif isinstance(value, dict):
        write_dict(parent.create_group(name), value, digests)
    elif isinstance(value, (list, tuple)):
        g = parent.create_group(name)
        g.attrs["__type__"] = "tuple" if isinstance(value, tuple) else "list"
        g.attrs["__len__"] = len(value)
        for i, v in enumerate(value):
            _write_item(g, str(i), v, digests)
    else:
        raise CheckpointError(f"{parent.name}/{name}: cannot save a value of type "
                              f"{type(value).__name__} (allowed: tensors, numpy arrays, JSON "
                              f"values, dicts, lists, tuples)")


def attr_str(obj, name):
    v = obj.attrs[name]
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


def read_item(obj, digests: dict | None = None):
    """Decode a member written by :func:`write_dict`; with ``digests`` (the record made at
    write time), each dataset's bytes are checked before they are decoded and its entry is
    popped, so entries left over afterwards name datasets that were never found."""
    kind = attr_str(obj, "__type__")
    if kind == "tensor":
        arr = np.asarray(_read(obj, digests))
        dtype = getattr(torch, attr_str(obj, "torch_dtype"))
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
        return np.asarray(_read(obj, digests))
    if kind == "npscalar":
        return np.asarray(_read(obj, digests))[()]
    if kind in ("json", "json_tuple"):
        text = _read(obj, digests)
        value = json.loads(text.decode("utf-8") if isinstance(text, bytes) else text)
        return tuple(value) if kind == "json_tuple" else value
    if kind == "dict":
        keys = json.loads(attr_str(obj, "__keys__"))
        names = json.loads(attr_str(obj, "__names__"))
        # the names are a function of the keys, and they are the members: a changed key, name
        # or member is refused, not read as another state
        if not isinstance(keys, list) or names != _member_names(keys) or \
                sorted(obj.keys()) != sorted(names):
            raise CheckpointError(f"{obj.name}: its keys, member names and members disagree "
                                  f"(the structure was damaged)")
        return {k: read_item(obj[n], digests) for k, n in zip(keys, names)}
    if kind in ("list", "tuple"):
        n, members = int(obj.attrs["__len__"]), sorted(obj.keys())
        # the count first: a damaged length (up to 2**63) must not build its list of names
        if n != len(members) or members != sorted(str(i) for i in range(n)):
            raise CheckpointError(f"{obj.name}: its length and members disagree (the structure "
                                  f"was damaged)")
        items = [read_item(obj[str(i)], digests) for i in range(n)]
        return tuple(items) if kind == "tuple" else items
    raise CheckpointError(f"{obj.name}: unknown stored type {kind!r}")
