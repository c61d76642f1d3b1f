"""The samples an inference or a solve runs on: parameter vectors drawn by seed or read from
``--params``, or input fields read from ``--inputs`` (``deepfusion infer`` / ``solve``), with
the checks that name what is wrong in the file and how to fix it."""
from __future__ import annotations

import numpy as np

from diffnet.problems import check_derived_channels
from diffnet.validation import grid_axes

from deepfusion.engine.predict.pipeline import Samples
from deepfusion.app import fields_file as h5io
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


def range_refusal(problem, params: np.ndarray, where: str) -> str:
    """The message refusing parameters outside ``problem.param_bounds()`` by more than the
    range's width (or, for a range of one value, by more than its magnitude, at least 1),
    where the network's answer is noise, often NaN; "" when none is that far."""
    bounds = problem.param_bounds()
    for j, name in enumerate(problem.param_names):
        lo, hi = (float(v) for v in bounds[j])
        reach = (hi - lo) or max(abs(lo), 1.0)
        col = params[:, j]
        far = np.flatnonzero((col < lo - reach) | (col > hi + reach))
        if len(far):
            return (f"{where}: {len(far)} of {len(col)} samples have {name} far outside the "
                    f"trained range [{lo:g}, {hi:g}] (e.g. sample {far[0]}: {col[far[0]]:g}); "
                    f"values up to the range's width beyond it, [{lo - reach:g}, "
                    f"{hi + reach:g}], are answered with a warning, farther ones are refused")
    return ""


def _params_from_file(problem, path) -> np.ndarray:
    params, names = h5io.read_params_file(path)
    want = list(problem.param_names)
    if names and names != want:
        raise ValueError(f"--params {path} names the parameters {names}, but problem "
                         f"{problem.name!r} takes {want} (in this order)")
    return check_params(problem, params, f"--params {path}")


def check_params(problem, params, where: str = "params") -> np.ndarray:
    """``params`` as float64 (n, k) parameter vectors of ``problem``, finite; ValueError naming
    ``where`` (the flag and file, or the argument) and the shape expected."""
    want = list(problem.param_names)
    try:
        params = np.asarray(params, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{where} must be numbers, (n, {len(want)}) for problem "
                         f"{problem.name!r}, got {type(params).__name__}") from None
    if params.ndim != 2 or params.shape[1] != len(want):
        raise ValueError(f"{where}: each vector needs {len(want)} values {want} for "
                         f"problem {problem.name!r}, got shape {params.shape}")
    if not len(params):
        raise ValueError(f"{where} holds no parameter vectors")
    if not np.all(np.isfinite(params)):
        raise ValueError(f"{where} holds non-finite values")
    return params


def _fields_from_file(problem, path):
    """(problem with the file's grid, network inputs (N, C, *grid) float64) from --inputs."""
    d = h5io.read_input_fields(path)
    if d["problem"] and d["problem"] != problem.name:
        raise ValueError(f"--inputs {path} was made for problem {d['problem']!r}, not "
                         f"{problem.name!r}")
    return fields_inputs(problem, d["inputs"], d["channels"], f"--inputs {path}", "/inputs",
                         "or name them in a 'channels' attribute of /inputs")


def fields_inputs(problem, x, channels, where: str, what: str = "the array",
                  naming: str = "or name the channels you give"):
    """(problem with the fields' grid, network inputs (N, C, *grid) float64) from fields ``x``
    (N, C, *grid) whose channels are named ``channels`` (None: the problem's own, in order).

    Which channels the problem needs or derives is the problem's business
    (``Problem.inputs_from_fields``), and so is how a derived channel follows from the
    others: a given one that does not is refused (``Problem.derived_channels``). ValueError naming ``where`` (the flag and file, or the
    argument) and ``what`` (the dataset), and the fix (``naming``: how to name channels, for
    a problem that derives some).
    """
    names = list(channels or problem.input_channels)
    need = list(problem.input_channels)
    if channels is None and x.ndim == len(problem.grid) + 1:
        raise ValueError(f"{where}: {what} has shape {x.shape}, but fields of shape "
                         f"(N, C, {grid_axes(len(problem.grid))}) are expected, C = {len(need)} "
                         f"{need}: an axis seems missing, the channel axis (x[:, None] for one "
                         f"channel) or the sample axis (x[None] for one sample)")
    if x.ndim < 2:
        raise ValueError(f"{where}: {what} has shape {x.shape}: give fields of shape "
                         f"(N, C, {grid_axes(len(problem.grid))}), C = {len(need)} {need}")
    if channels is None and x.shape[1] != len(need):
        raise ValueError(f"{where}: {what} has {x.shape[1]} channels, but problem "
                         f"{problem.name!r} takes {len(need)}, {need} in this order; {naming}")
    if len(names) != x.shape[1] or len(set(names)) != len(names):
        raise ValueError(f"{where}: {what} has {x.shape[1]} channels, but its channel names "
                         f"are {channels}; give one distinct name per channel (problem "
                         f"{problem.name!r} needs {need})")
    if x.ndim - 2 != len(problem.grid):
        want = f"(N, C, {grid_axes(len(problem.grid))})"
        raise ValueError(f"{where}: {what} has shape {x.shape}, but problem "
                         f"{problem.name!r} has {len(problem.grid)} grid axes: give fields of "
                         f"shape {want}")
    if tuple(x.shape[2:]) != tuple(problem.grid):
        from diffnet.problems import get_problem
        try:
            problem = get_problem(type(problem), **{**problem.config(), "grid": list(x.shape[2:])})
        except ValueError as e:
            raise ValueError(f"{where}: {what} holds fields on a "
                             f"{'x'.join(map(str, x.shape[2:]))} grid, which problem "
                             f"{problem.name!r} cannot take: {e}") from None
    try:
        made = problem.inputs_from_fields({n: x[:, i] for i, n in enumerate(names)})
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    bad = int(np.size(made) - np.count_nonzero(np.isfinite(made)))
    if bad:  # a problem's own check should have said which field; never pass NaN to the network
        raise ValueError(f"{where}: the network inputs made from {what} hold {bad} "
                         f"non-finite value(s) (NaN or inf); give finite fields")
    check_derived_channels(problem, made, where)
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
