"""A trained checkpoint as a solver in Python: ``deepfusion.load(path)`` returns a
:class:`Solver`, whose ``predict`` maps input fields or parameter vectors to the answer.

The answer is the one ``deepfusion infer`` writes: the same prediction service
(``deepfusion.engine.predict.service``: the checkpoint's loader, the pipeline, the network,
boundary imposition and answer head of ``diffnet.answer.Answer``, the same work-grid rule (the
network runs on its training grid and its answer is interpolated, unless asked otherwise), the
same batches; at the same threads the numbers are identical. One process, no MPI: a domain
split is ``deepfusion infer --domain``'s.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

from diffnet.problems import has_answer_residual

from deepfusion.app.fields_run import DEFAULT_SEED
from deepfusion.app.options import correction_of
from deepfusion.app.samples import (Samples, check_params, fields_inputs, range_refusal,
                                    range_warnings)
from deepfusion.engine.predict import service
from deepfusion.engine.predict.calibration import threshold_for
from deepfusion.engine.predict.loader import (problem_from_spec, grid_note, grid_text, parse_grid,
                                              resolve_work_grid, work_problem)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float64": torch.float64,
          "fp64": torch.float64, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def load(path, *, work_grid: str = "trained", batch: int = 8, threads: int | None = None,
         dtype=None, options: dict | None = None, correction: int | None = None) -> "Solver":
    """The solver of a checkpoint file, or of a run directory's newest complete checkpoint.

    Args:
        work_grid: the grid the network runs on when an answer is asked on another grid:
            'trained' (default: its training grid, the answer interpolated), 'as-is' (the
            asked grid itself) or a grid (a tuple or 'HxW'); ``predict`` can override it.
        batch: samples per forward pass (bounds memory; 8, as ``infer --batch``).
        threads: torch threads while predicting (None: torch's current setting).
        dtype: the network's dtype: None (the checkpoint's), 'float32', 'float64' or
            'bfloat16' (CPUs with avx512_bf16 / amx_bf16 only), or a torch dtype.
        options: problem options that replace the checkpoint's (``infer --set
            problem.options.KEY=VALUE``), e.g. how the answer is formed.
        correction: cells per axis of the answers' coarse correction (``infer --correction``,
            docs/coarse-correction.md); None: the run's
            ``problem.correction``; 0: none. ``predict`` can override it.

    Raises ValueError naming the problem: no checkpoint there, a file that is not a
    checkpoint, or options that do not fit the network.
    """
    from deepfusion.engine.predict.loader import load as load_checkpoint

    loaded = load_checkpoint(path, options=options)
    for level, text in loaded.notes:   # after the load: a file that is no checkpoint says only that
        if level == "WARNING":
            warnings.warn(text, stacklevel=3)
    return Solver(loaded, work_grid=work_grid, batch=batch, threads=threads, dtype=dtype,
                  options=options, correction=correction)


def as_dtype(dtype) -> torch.dtype | None:
    """None, a torch dtype or its name -> the torch dtype; bf16 refused on a CPU without it."""
    if dtype is None or isinstance(dtype, torch.dtype):
        out = dtype
    elif str(dtype).lower() in DTYPES:
        out = DTYPES[str(dtype).lower()]
    else:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or a torch dtype, got {dtype!r}")
    if out is torch.bfloat16:
        from deepfusion.engine.parallel.layout import check_precision

        check_precision("bf16", setting="dtype='{}'")
    return out


class Solver:
    """A trained network answering its problem: see :func:`load` and docs/python-api.md.

    Attributes: ``problem`` (on the training grid), ``grid`` (the training grid),
    ``channels`` (the input channels, in order), ``param_names``, ``param_bounds``,
    ``dtype``, ``step``, ``path`` (the checkpoint), ``meta`` (its metadata), ``module`` (the
    answer as a differentiable torch module on the training grid).
    """

    def __init__(self, loaded, *, work_grid="trained", batch=8, threads=None, dtype=None,
                 options=None, correction=None):
        dtype = as_dtype(dtype)
        model, problem = loaded.model, loaded.problem
        self.model = (model if dtype is None else model.to(dtype)).requires_grad_(False)
        self.problem, self.meta, self.path = problem, loaded.meta, loaded.path
        self.options = dict(options or {})
        self.work_grid, self.threads = self._grid_text(work_grid), threads
        self.batch = check_batch(batch)
        resolve_work_grid(self.work_grid, self.meta)   # a bad spelling fails here, not at predict
        self.channels_last = loaded.channels_last
        # the coarse correction of every answer (predict can override it); not in ``module``,
        # which is the network's answer as a differentiable (exportable) torch module
        self.correction = correction_of(correction, loaded, problem, "load(correction=...)")
        self.module = service.answer_module(self.model, problem)
        self._problems: dict = {self.grid: problem}
        self.last_refine: dict = {}     # predict(refine=...)'s per-sample records
        self.last_check: dict = {}      # predict(check=True)'s residuals and flags
        self._on: dict = {}

    # -- what it is ------------------------------------------------------------------------------

    @property
    def grid(self) -> tuple[int, ...]:
        return tuple(self.problem.grid)

    @property
    def channels(self) -> tuple[str, ...]:
        return tuple(self.problem.input_channels)

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(self.problem.param_names)

    @property
    def param_bounds(self) -> np.ndarray:
        return np.asarray(self.problem.param_bounds(), dtype=np.float64)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def step(self) -> int:
        return int(self.meta.get("step", -1))

    def __repr__(self) -> str:
        return (f"Solver({self.problem.name!r} on {grid_text(self.grid)}, inputs "
                f"{list(self.channels)} (N, {len(self.channels)}, {grid_text(self.grid)}), "
                f"params {list(self.param_names)}, step {self.step}, {self.dtype}, "
                f"work_grid={self.work_grid!r}, checkpoint {self.path!r})")

    # -- answers ---------------------------------------------------------------------------------

    def sample(self, n: int, seed: int = DEFAULT_SEED) -> np.ndarray:
        """Parameter vectors (n, k) float64 of draws 0..n-1 of ``seed`` from the problem's
        parameter range: those of ``deepfusion infer --samples n --seed seed`` (and ``solve``).
        Feed them to ``predict(params=...)`` or ``inputs``."""
        if isinstance(n, bool) or int(n) < 1:
            raise ValueError(f"sample(n): n must be a positive integer, got {n!r}")
        return self.problem.sample_params(int(seed), np.arange(int(n)))

    def inputs(self, params, grid=None) -> np.ndarray:
        """The network inputs (n, C, *grid) float64 of parameter vectors (n, k), rendered on
        ``grid`` (default: the training grid)."""
        problem = self._problem(grid)
        params = check_params(problem, params, "inputs(params)")
        return problem.build_input(params, dtype=torch.float64).numpy()

    def predict(self, inputs=None, *, params=None, grid=None, work_grid=None, batch=None,
                threads=None, refine=None, check: bool = False, correction=None):
        """The answers (N, *grid) to input fields or to parameter vectors.

        ``inputs``: (N, C, *grid) numpy array or torch tensor, channels in ``self.channels``
        order (returns the same kind), or a dict of channel name -> (N, *grid) (a problem may
        derive a missing channel from the others; returns numpy). ``params``: (N, k)
        parameter vectors (rendered on the work grid, as in training). Exactly one of the two.
        ``grid``: the answer's grid (default: the inputs' grid, or the training grid for
        ``params``); ``work_grid``, ``batch``, ``threads``: override :func:`load`'s.
        ``refine``: a tolerance, e.g. 1e-8: each answer is refined by the problem's iterative
        reference solver to that relative residual (``infer --refine``, docs/refine.md) and
        returned in float64; the per-sample iterations and residuals are then on
        ``last_refine`` (ValueError, before any work, for a problem without such a solver).
        ``check``: the answers' residuals and whether each is above the threshold (the one
        calibrated for this model, else the problem's constant one) are then on
        ``last_check`` ({"residual": (N,), "flagged": (N,), "threshold" (None: none, only
        non-finite answers flagged), "threshold_source", "threshold_text"},
        docs/answer-check.md; ValueError, before any work, for a problem without one).

        ``correction``: cells per axis of the answers' coarse correction (None: the solver's,
        the run's ``problem.correction`` unless :func:`load` was given one; 0: none).

        The dtype is the network's (float32 for a bfloat16 network). ValueError naming what is
        wrong: a wrong channel count or grid axes (a missing axis named), non-finite values,
        a grid the network cannot take as is, ``batch`` not a positive integer, parameters
        farther outside the trained range than its width. No samples: the empty answer
        (0, *grid). A non-finite answer: a RuntimeWarning naming the samples.
        """
        from deepfusion.engine.predict.refine import check_refine, refine_batch

        check_refine(self.problem, refine, "predict(refine=...)")
        if check and not has_answer_residual(self.problem):
            raise ValueError(f"predict(check=True): problem {self.problem.name!r} has no "
                             f"answer residual (it does not define answer_residual)")
        batch = self.batch if batch is None else check_batch(batch)
        kind, samples, problem = self._samples(inputs, params, grid)
        if not samples.n:   # no samples, no work: the empty answer of the kind asked
            u = self.empty_answer(problem, refine)
            return u if kind == "torch" else u.numpy()
        problem, work = self._on_grid(problem.grid, work_grid)
        m = self.correction if correction is None else \
            correction_of(correction, None, work or problem, "predict(correction=...)")
        u = self._run(problem, work, samples, batch, threads or self.threads, m)
        warn_nonfinite(u)
        if refine is not None:
            x = samples.inputs(problem, 0, samples.n, torch.float64)
            u, self.last_refine = refine_batch(problem, u, x, refine)
            u = torch.from_numpy(u)
        if check:   # the inputs on the answer's grid (given fields resampled to it)
            x = samples.on_grid(problem, 0, samples.n, torch.float64)
            t = threshold_for(self.meta, problem)
            self.last_check = {**problem.check_answers(u, x, t.value), "threshold": t.value,
                               "threshold_source": t.source, "threshold_text": t.text}
        return u if kind == "torch" else u.numpy()

    # -- the steps -------------------------------------------------------------------------------

    def _samples(self, inputs, params, grid):
        """(kind of the answer, Samples, problem on the answer's grid)."""
        if (inputs is None) == (params is None):
            raise ValueError("predict: give exactly one of inputs (N, C, *grid) fields or "
                             "params= (N, k) parameter vectors")
        if params is not None:
            problem = self._problem(grid)
            p = check_params(problem, params, "predict(params=...)")
            far = range_refusal(problem, p, "predict(params=...)")
            if far:   # the network's answer there is noise, often NaN: refused, not warned
                raise ValueError(far)
            for w in range_warnings(problem, p):
                warnings.warn(w, stacklevel=3)
            return "numpy", Samples(p), problem
        kind = "torch" if isinstance(inputs, torch.Tensor) else "numpy"
        x, names = fields_array(inputs)
        problem, made = fields_inputs(self.problem, x, names, "predict(inputs)", "inputs",
                                      "or give a dict of channel name -> (N, *grid) fields")
        if grid is not None:
            problem = self._problem(grid)
        return kind, Samples(np.zeros((len(made), 0)), made), problem

    def _problem(self, grid):
        """The solver's problem on ``grid`` (None: the training grid), built once per grid."""
        grid = self.grid if grid is None else tuple(self._grid_text(grid, as_grid=True))
        if grid not in self._problems:
            self._problems[grid] = problem_from_spec(type(self.problem), self.problem.config(),
                                                 grid, where="grid")
        return self._problems[grid]

    def _on_grid(self, grid, work_grid):
        """(problem on ``grid``, work problem or None), checked once per grid and work grid;
        a network run on a grid it was not trained on warns what that costs."""
        text = self._grid_text(work_grid) if work_grid is not None else self.work_grid
        key = (tuple(grid), text)
        if key not in self._on:
            problem = self._problem(grid)
            work = work_problem(self.model, problem, self.meta, text, f"grid {grid_text(grid)}")
            note = grid_note(self.model, self.meta, grid, work, explicit=True)
            if note:
                warnings.warn(note, stacklevel=3)
            self._on[key] = (problem, work)
        return self._on[key]

    def empty_answer(self, problem, refine) -> torch.Tensor:
        """The answer to no samples: (0, *grid) in the dtype an answer would have."""
        dtype = torch.float64 if refine is not None else self.dtype
        dtype = torch.float32 if dtype == torch.bfloat16 else dtype
        return torch.zeros((0, *problem.grid), dtype=dtype)

    def _run(self, problem, work, samples, batch: int, threads, correction: int = 0):
        pipe = service.pipeline(self.model, problem, work=work, channels_last=self.channels_last,
                                correction=correction)
        before = torch.get_num_threads()
        try:
            if threads:
                torch.set_num_threads(int(threads))
            done = service.predict_here(pipe, samples, int(batch), keep_inputs=False)
        finally:
            torch.set_num_threads(before)
        u = torch.cat([b.u for b in done.batches]).clone()   # out of inference mode: a plain tensor
        return u.float() if u.dtype == torch.bfloat16 else u

    @staticmethod
    def _grid_text(value, as_grid: bool = False):
        """A grid given as a tuple/list or text -> its text (or, ``as_grid``, the tuple)."""
        if isinstance(value, (tuple, list)):
            value = grid_text(value)
        if as_grid:
            return parse_grid(value)
        return str(value)


def check_batch(batch) -> int:
    """``batch`` (samples per forward pass) as an int; ValueError unless a positive integer."""
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
        raise ValueError(f"batch must be a positive integer, got {batch!r}")
    return int(batch)


def warn_nonfinite(u: torch.Tensor) -> None:
    """A warning naming the samples whose answer holds NaN or inf (the network broke down on
    them: inputs far from what it was trained on, most often)."""
    bad = (~torch.isfinite(u.reshape(len(u), -1))).any(dim=1).nonzero().flatten().tolist()
    if bad:
        shown = ", ".join(map(str, bad[:10])) + (", ..." if len(bad) > 10 else "")
        warnings.warn(f"predict: the answers of {len(bad)} of {len(u)} samples hold non-finite "
                      f"values (NaN or inf): samples {shown}; their inputs are likely far from "
                      f"those the network was trained on", RuntimeWarning, stacklevel=3)


def fields_array(inputs) -> tuple[np.ndarray, list | None]:
    """(fields (N, C, *grid) as a numpy array, channel names or None) from an array, a tensor
    or a dict of channel name -> (N, *grid)."""
    if isinstance(inputs, dict):
        if not inputs:
            raise ValueError("predict(inputs): the dict of fields is empty; give channel "
                             "name -> (N, *grid) arrays")
        names = [str(k) for k in inputs]
        arrays = [as_numpy(v, f"field {k!r}") for k, v in inputs.items()]
        shapes = {a.shape for a in arrays}
        if len(shapes) > 1:
            raise ValueError(f"predict(inputs): the fields have different shapes "
                             f"{[a.shape for a in arrays]}; give each as (N, *grid)")
        return np.stack(arrays, axis=1), names
    return as_numpy(inputs, "predict(inputs)"), None


def as_numpy(value, name: str) -> np.ndarray:
    """A float64 numpy array of a numpy array, a torch tensor or a nested list of numbers."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        value = value.float() if value.dtype == torch.bfloat16 else value
        value = value.numpy()
    try:
        return np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an array of numbers, got "
                         f"{type(value).__name__}") from None
