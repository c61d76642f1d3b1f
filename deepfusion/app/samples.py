"""The samples an inference or a solve runs on: parameter vectors drawn by seed or read from
``--params``, or input fields read from ``--inputs`` (``deepfusion infer`` / ``solve``), with
the checks that name what is wrong in the file and how to fix it."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from diffnet.validation import grid_axes

from . import fields as h5io


@dataclass
class Samples:
    """N samples: parameter vectors (N, k) (k = 0 for given fields) and/or fields (N, C, *grid)."""

    params: np.ndarray
    fields: np.ndarray | None = None

    @property
    def n(self) -> int:
        return len(self.params)

    def inputs(self, problem, lo: int, hi: int, dtype=torch.float32) -> torch.Tensor:
        if self.fields is not None:
            return torch.as_tensor(self.fields[lo:hi], dtype=dtype)
        return problem.build_input(self.params[lo:hi], dtype=dtype)


def range_warnings(problem, params: np.ndarray) -> list[str]:
    """One message per parameter with values outside ``problem.param_bounds()``."""
    out = []
    bounds = problem.param_bounds()
    for j, name in enumerate(problem.param_names):
        lo, hi = bounds[j]
        col = params[:, j]
        bad = int(np.sum((col < lo) | (col > hi)))
        if bad:
            out.append(f"{bad} of {len(col)} samples have {name} outside the trained range "
                       f"[{lo:g}, {hi:g}] (min {col.min():g}, max {col.max():g}): extrapolation, "
                       f"expect larger errors")
    return out


def _params_from_file(problem, path) -> np.ndarray:
    params, names = h5io.read_params_file(path)
    want = list(problem.param_names)
    if names and names != want:
        raise ValueError(f"--params {path} names the parameters {names}, but problem "
                         f"{problem.name!r} takes {want} (in this order)")
    if params.ndim != 2 or params.shape[1] != len(want):
        raise ValueError(f"--params {path}: each vector needs {len(want)} values {want} for "
                         f"problem {problem.name!r}, got shape {params.shape}")
    if not np.all(np.isfinite(params)):
        raise ValueError(f"--params {path} holds non-finite values")
    return params


def _fields_from_file(problem, path):
    """(problem with the file's grid, network inputs (N, C, *grid) float64) from --inputs.

    The channels are named by the file's 'channels' attribute (without one, the problem's own
    channels in order); which of them the problem needs or derives is the problem's business
    (``Problem.inputs_from_fields``).
    """
    d = h5io.read_input_fields(path)
    if d["problem"] and d["problem"] != problem.name:
        raise ValueError(f"--inputs {path} was made for problem {d['problem']!r}, not "
                         f"{problem.name!r}")
    x = d["inputs"]
    names = d["channels"] or list(problem.input_channels)
    if len(names) != x.shape[1] or len(set(names)) != len(names):
        raise ValueError(f"--inputs {path}: /inputs has {x.shape[1]} channels, but its "
                         f"'channels' attribute is {d['channels'] or 'missing'}; give one "
                         f"distinct name per channel (problem {problem.name!r} needs "
                         f"{list(problem.input_channels)})")
    if x.ndim - 2 != len(problem.grid):
        want = f"(N, C, {grid_axes(len(problem.grid))})"
        raise ValueError(f"--inputs {path}: /inputs has shape {x.shape}, but problem "
                         f"{problem.name!r} has {len(problem.grid)} grid axes: give fields of "
                         f"shape {want}")
    if tuple(x.shape[2:]) != tuple(problem.grid):
        from diffnet.problems import get_problem  # (lazy, as in inference.py)
        try:
            problem = get_problem(type(problem), **{**problem.config(), "grid": list(x.shape[2:])})
        except ValueError as e:
            raise ValueError(f"--inputs {path}: /inputs holds fields on a "
                             f"{'x'.join(map(str, x.shape[2:]))} grid, which problem "
                             f"{problem.name!r} cannot take: {e}") from None
    try:
        made = problem.inputs_from_fields({n: x[:, i] for i, n in enumerate(names)})
    except ValueError as e:
        raise ValueError(f"--inputs {path}: {e}") from None
    bad = int(np.size(made) - np.count_nonzero(np.isfinite(made)))
    if bad:  # a problem's own check should have said which field; never pass NaN to the network
        raise ValueError(f"--inputs {path}: the network inputs made from /inputs hold {bad} "
                         f"non-finite value(s) (NaN or inf); give finite fields")
    return problem, made


def resolve_samples(problem, *, sample=None, seed=0, params=None, inputs=None):
    """(problem, Samples, warnings) from exactly one of --samples / --params / --inputs."""
    given = [o for o, v in (("--samples", sample), ("--params", params), ("--inputs", inputs))
             if v is not None]
    if len(given) != 1:
        raise ValueError("choose the inputs with exactly one of --samples N, --params FILE, "
                         f"--inputs FILE.h5 (got {given or 'none'})")
    if inputs is not None:
        problem, x = _fields_from_file(problem, inputs)
        return problem, Samples(np.zeros((len(x), 0)), x), []
    if params is not None:
        p = _params_from_file(problem, params)
        return problem, Samples(p), range_warnings(problem, p)
    if isinstance(sample, bool) or int(sample) < 1:
        raise ValueError(f"--samples must be a positive integer, got {sample!r}")
    return problem, Samples(problem.sample_params(int(seed), np.arange(int(sample)))), []
