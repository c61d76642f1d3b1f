"""HDF5 files of fields written by ``deepfusion infer`` and ``deepfusion solve`` (read by
``deepfusion compare`` and by other tools).

File layout (one file per command, samples along the first axis; ``*grid`` is (H, W) on 2-D
grids and (D, H, W) on 3-D grids)::

    /u                float32 (N, *grid)    the solution (prediction or reference); float64
                                            when refined (``infer --refine``)
    /inputs           float32 (N, C, *grid) the network's input fields
        attr channels                       names of the C channels (the problem's input_channels)
    /params           float64 (N, k)        the parameter vectors ((N, 0) for --inputs runs)
    /param_names      string (k,)           names of the k parameters, e.g. ["omega_1", ...]
                                            (older files: attribute ``names`` of /params)
    /coords/<axis>    float64 (n_axis,)     one 1-D node coordinate array per grid axis
    /<name>           (N,)                  per-sample records of the command, e.g. with
                                            ``infer --refine``: refine_iterations,
                                            refine_residual, refine_initial_residual,
                                            refine_seconds (``deepfusion.engine.predict.refine``)
    /residual         float64 (N,)          predictions checked (``infer``, by default):
                                            the answer's residual
                                            (``Problem.answer_residual``: 0 solves the
                                            discrete equations, 1 is no better than the lift)
    /flagged          bool (N,)             residual above the threshold, or not finite: an
                                            answer not to trust
    root attributes:
        format              "deepfusion-fields", format_version 1
        axes                names of the grid axes of /u (its dimensions after N), in order
                            (the problem's axes, e.g. ["y", "x"] or ["z", "y", "x"])
        problem             the problem's registry name
        problem_kwargs      JSON of the problem's constructor options (incl. "grid")
        source              the checkpoint path (infer) or "reference:<method>" (solve)
        inputs_from         the draws: "sample:N seed:S", "params:PATH" or "inputs:PATH"
        kind                "prediction" or "reference"
        has_reference       whether the problem has a reference solver (False: compare refuses)
        seconds_per_sample  compute seconds per sample (network forward, or solver call),
                            summed over ranks and divided by N; I/O and gathers excluded
        wall_seconds, ranks, batch   the whole command's wall time, MPI ranks, batch size
        residual_threshold  with /residual: the threshold /flagged compares it with (NaN:
                            none, only non-finite residuals are flagged)
        residual_threshold_source  "calibrated" (the model's own, stored in its checkpoint),
                            "family" (the problem's constant) or "none"
        residual_kind       "family" (the problem's own residual) or "loss" (its loss's)
        complete            True, written last

Writing is atomic (:class:`deepfusion.engine.checkpoint.atomic.Staged`): the data go to
``<out>.tmp.<pid>``, which is closed, fsync'ed and ``os.replace``'d onto ``<out>`` (then the
directory is fsync'ed). An interrupted command leaves no half-written file under the output
name (at most, when killed outright, a ``.tmp.<pid>`` file next to it).

Every file gets an XDMF sidecar ``<out without .h5>.xmf`` (:mod:`.xdmf`), written after the
HDF5 file is published: open it in ParaView to see the samples' solution and input fields on
the node grid (one time step per sample).
"""
from __future__ import annotations

import json
import os

import h5py
import numpy as np

from deepfusion.engine.checkpoint.atomic import Staged
from deepfusion.engine.predict.refine import DATASETS as REFINE_DATASETS
from deepfusion.app.xdmf import write_sidecar

FORMAT = "deepfusion-fields"
FORMAT_VERSION = 1
# the per-sample datasets of a checked prediction: name -> dtype
CHECK_DATASETS = {"residual": "float64", "flagged": "bool"}


def check_output_path(path) -> str:
    """Raise OSError naming the problem if ``path`` cannot be written; return it absolute."""
    path = os.path.abspath(os.fspath(path))
    d = os.path.dirname(path)
    if os.path.isdir(path):
        raise OSError(f"--out {path} is a directory; give a file name such as {path}/preds.h5")
    if not os.path.isdir(d):
        raise OSError(f"cannot write --out {path}: directory {d} does not exist (create it first)")
    if not os.access(d, os.W_OK):
        raise OSError(f"cannot write --out {path}: directory {d} is not writable")
    return path


class FieldWriter:
    """Streams blocks of samples into a new fields file, then publishes it atomically.

    Usage: ``w = FieldWriter(path, n, ...); w.write(lo, u, inputs); w.close(attrs)``; on any
    error call ``w.discard()`` (the temp file is removed, ``path`` untouched).
    """

    def __init__(self, path, *, n: int, grid, channels, params, param_names, coords: dict,
                 axes, u_dtype: str = "float32", extra: dict | None = None):
        self.path = check_output_path(path)
        self.staged = Staged(self.path)
        self.tmp = self.staged.tmp
        grid = tuple(int(v) for v in grid)
        self.layout = {"n": n, "grid": grid, "channels": list(channels), "coords": coords,
                       "axes": list(axes)}
        try:
            self.f = h5py.File(self.tmp, "w")
        except OSError as e:
            raise OSError(f"cannot write --out {self.path}: {e}") from None
        f = self.f
        f.create_dataset("u", shape=(n, *grid), dtype=u_dtype)
        for name, dtype in (extra or {}).items():    # per-sample records, (n,) each
            f.create_dataset(name, shape=(n,), dtype=dtype)
        x = f.create_dataset("inputs", shape=(n, len(channels), *grid), dtype="float32")
        x.attrs["channels"] = list(channels)
        p = f.create_dataset("params", data=np.asarray(params, dtype=np.float64).reshape(n, -1))
        # a dataset, not an attribute: attributes are limited to 64 KB, and a problem whose
        # parameters are a field's spectral coefficients has thousands of names
        f.create_dataset("param_names", data=np.array(list(param_names), dtype=object),
                         dtype=h5py.string_dtype())
        g = f.create_group("coords")
        for name in axes:
            g.create_dataset(name, data=np.asarray(coords[name], dtype=np.float64))
        f.attrs["axes"] = list(axes)

    def write(self, lo: int, u, inputs, extra: dict | None = None) -> None:
        """Store samples [lo, lo + len(u)): u (b, *grid), inputs (b, C, *grid) and the
        per-sample records ``extra`` (name -> (b,), datasets made by the constructor)."""
        hi = lo + len(u)
        self.f["u"][lo:hi] = np.asarray(u, dtype=self.f["u"].dtype)
        self.f["inputs"][lo:hi] = np.asarray(inputs, dtype=np.float32)
        for name, values in (extra or {}).items():
            self.f[name][lo:hi] = values

    def close(self, attrs: dict) -> str:
        """Write the root attributes, fsync and publish under the output name; then its XDMF
        sidecar. Returns the HDF5 file's path."""
        f = self.f
        f.attrs["format"] = FORMAT
        f.attrs["format_version"] = FORMAT_VERSION
        for k, v in attrs.items():
            f.attrs[k] = json.dumps(v) if isinstance(v, dict) else v
        f.attrs["complete"] = True
        f.close()
        path = self.staged.publish()
        write_sidecar(path, **self.layout)
        return path

    def discard(self) -> None:
        try:
            self.f.close()
        except Exception:  # noqa: BLE001 - already closed or broken
            pass
        self.staged.discard()


def _str_list(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (bytes, str)):
        value = [value]
    return [v.decode() if isinstance(v, bytes) else str(v) for v in value]


def _param_names(f) -> list[str]:
    """The /param_names dataset, or (files written before it) the names attribute of /params."""
    if "param_names" in f:
        return _str_list(f["param_names"][()])
    return _str_list(f["params"].attrs.get("names")) if "params" in f else []


def _attr(f, name, default=None):
    v = f.attrs.get(name, default)
    return v.decode() if isinstance(v, bytes) else v


def _open(path, what: str):
    path = os.fspath(path)
    if not os.path.exists(path):
        raise OSError(f"{what} {path} not found")
    try:
        return h5py.File(path, "r")
    except OSError as e:
        raise ValueError(f"{what} {path} is not a readable HDF5 file (truncated or corrupt?): "
                         f"{e}") from None


def read_fields(path) -> dict:
    """Everything in a fields file written by infer/solve (see the module docstring)."""
    f = _open(path, "fields file")
    with f:
        if _attr(f, "format") != FORMAT or "u" not in f:
            raise ValueError(f"{path} is not a DeepFusion fields file (written by "
                             f"'deepfusion infer' or 'deepfusion solve'): no format attribute "
                             f"'{FORMAT}' or no /u dataset")
        axes = _str_list(f.attrs.get("axes"))
        out = {"u": f["u"][()], "inputs": f["inputs"][()] if "inputs" in f else None,
               "channels": _str_list(f["inputs"].attrs.get("channels")) if "inputs" in f else [],
               "params": f["params"][()] if "params" in f else np.zeros((len(f["u"]), 0)),
               "param_names": _param_names(f),
               "axes": axes, "coords": {a: f["coords"][a][()] for a in axes if a in f["coords"]}}
        for k in ("problem", "source", "kind", "seconds_per_sample", "wall_seconds", "ranks",
                  "batch", "inputs_from", "has_reference"):
            out[k] = _attr(f, k)
        for k in CHECK_DATASETS:   # checked predictions only
            out[k] = f[k][()] if k in f else None
        for k in REFINE_DATASETS:  # refined predictions only
            out[k] = f[k][()] if k in f else None
        t = _attr(f, "residual_threshold")
        out["residual_threshold"] = None if t is None or t != t else float(t)   # NaN: none
        for k in ("residual_threshold_source", "residual_kind"):
            out[k] = _attr(f, k)
        wg = f.attrs.get("work_grid")  # predictions only: the grid the network ran on
        out["work_grid"] = [int(v) for v in wg] if wg is not None else None
        kw = _attr(f, "problem_kwargs", "{}")
        out["problem_kwargs"] = json.loads(kw) if isinstance(kw, str) else {}
    return out


def read_input_fields(path) -> dict:
    """The ``--inputs`` file: /inputs (N, C, H, W) or (N, C, D, H, W) (float), optional
    ``channels`` attribute on it and optional root ``problem`` attribute. Any fields file
    qualifies (whether the grid suits the problem is the problem's check)."""
    f = _open(path, "--inputs file")
    with f:
        if "inputs" not in f or not isinstance(f["inputs"], h5py.Dataset):
            raise ValueError(f"--inputs file {path} has no /inputs dataset: it needs /inputs of "
                             f"shape (N, C, H, W) (a 3-D problem: (N, C, D, H, W)) with an "
                             f"attribute 'channels' naming the C "
                             f"channels (the problem's input_channels, or the fields they are derived from)")
        x = f["inputs"]
        if x.ndim not in (4, 5):
            raise ValueError(f"--inputs {path}: /inputs must have shape (N, C, H, W) or, for a "
                             f"3-D problem, (N, C, D, H, W); got {x.shape}")
        if x.shape[0] == 0 or x.shape[1] == 0:
            what = "samples (N = 0)" if x.shape[0] == 0 else "channels (C = 0)"
            raise ValueError(f"--inputs {path}: /inputs holds no {what}, shape {x.shape}; "
                             f"write at least one sample of every input channel")
        return {"inputs": _numbers(x, f"--inputs {path}: /inputs"),
                "channels": _str_list(x.attrs.get("channels")),
                "problem": _attr(f, "problem")}


def _numbers(dataset, what: str) -> np.ndarray:
    """A dataset's values as float64, or ValueError naming it (strings, compound types)."""
    try:
        return np.asarray(dataset[()], dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} holds {dataset.dtype} values, not numbers ({e})") from None


def write_input_fields(path, inputs, channels, problem: str | None = None) -> None:
    """A minimal ``--inputs`` file (for users and tests): /inputs + channels (+ problem)."""
    with h5py.File(path, "w") as f:
        d = f.create_dataset("inputs", data=np.asarray(inputs, dtype=np.float32))
        d.attrs["channels"] = list(channels)
        if problem:
            f.attrs["problem"] = problem


def read_params_file(path) -> tuple[np.ndarray, list[str]]:
    """Parameter vectors from ``--params FILE``: (n, k) float64 and the names found (may be []).

    HDF5 (.h5/.hdf5): dataset /params with optional attribute ``names``. Text/CSV: one vector
    per line, separated by commas or whitespace; lines starting with '#' are comments; an
    optional first line of names (e.g. ``omega_1,omega_2,...``).
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise OSError(f"--params file {path} not found")
    if path.endswith((".h5", ".hdf5")):
        with _open(path, "--params file") as f:
            if "params" not in f or not isinstance(f["params"], h5py.Dataset):
                raise ValueError(f"--params {path}: no /params dataset (shape (n, k))")
            params = np.atleast_2d(_numbers(f["params"], f"--params {path}: /params"))
            if params.shape[0] == 0:
                raise ValueError(f"--params {path}: /params holds no parameter vectors, shape "
                                 f"{f['params'].shape}; write one row per sample")
            return params, _str_list(f["params"].attrs.get("names"))
    try:
        return _read_params_text(path)
    except UnicodeDecodeError:
        raise ValueError(f"--params {path} is not a text file; give one vector per line "
                         f"(text/CSV), or an HDF5 file named .h5 with /params (n, k)") from None


def _read_params_text(path: str) -> tuple[np.ndarray, list[str]]:
    rows, names = [], []
    with open(path) as fh:
        for lineno, line in enumerate(fh, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            tokens = [t for t in line.replace(",", " ").split()]
            try:
                rows.append([float(t) for t in tokens])
            except ValueError:
                if rows or names:
                    raise ValueError(f"--params {path} line {lineno}: not numbers: "
                                     f"{line!r}") from None
                names = tokens
    if not rows:
        raise ValueError(f"--params {path} holds no parameter vectors")
    widths = {len(r) for r in rows}
    if len(widths) != 1:
        raise ValueError(f"--params {path}: rows have different lengths {sorted(widths)}")
    return np.array(rows, dtype=np.float64), names
