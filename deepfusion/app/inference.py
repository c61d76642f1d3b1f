"""Inference with a trained generator, the reference solver on the same inputs, over MPI ranks.

The N samples are cut into global batches [k B, (k + 1) B) and the batches are divided over the
ranks in contiguous blocks, so every sample goes through the network in the same batch whatever
the number of ranks (identical bytes for any P). Ranks compute one batch per round; the round's
blocks are gathered and rank 0 streams them into the output file (memory: P batches at a time).

The samples themselves (drawn, or read from --params / --inputs): :mod:`deepfusion.app.samples`.
Files: see :mod:`deepfusion.app.fields_file`. :func:`compare_files` compares a prediction file with a
reference file (``deepfusion compare``); it lives in :mod:`deepfusion.app.compare`, re-exported
here.
"""
from __future__ import annotations

import math
import os
import time

import numpy as np
import torch

from deepfusion.app import fields_file as h5io
from deepfusion.app.options import as_set_flags
from deepfusion.app.compare import compare_files  # noqa: F401  (re-exported)
from deepfusion.app.samples import Samples


# ---------------------------------------------------------------------------------------------
# model and problem
# ---------------------------------------------------------------------------------------------

def parse_grid(text) -> tuple[int, ...] | None:
    """'HxW' or 'DxHxW' (or 'H,W', 'D,H,W') -> the node counts; None passes through. Whether
    the number of axes suits the problem is checked where the problem is built."""
    if text is None:
        return None
    try:
        grid = tuple(int(v) for v in str(text).lower().replace(",", "x").split("x"))
    except ValueError:
        grid = ()
    if len(grid) not in (2, 3):
        raise ValueError(f"--grid must look like HxW (e.g. 128x128) or, for a 3-D problem, "
                         f"DxHxW (e.g. 64x64x64), got {text!r}")
    return grid


def grid_text(grid) -> str:
    """(64, 64, 64) -> '64x64x64' (how --grid and the messages write a grid)."""
    return "x".join(str(int(v)) for v in grid)


def build_problem(name, kwargs: dict, grid=None, where: str = "--grid"):
    """The problem ``name`` (a registered name, 'module:Class', a plugin's entry point, or a
    Problem class) with options ``kwargs``, its grid replaced by ``grid`` if given (one with
    the wrong number of axes for the problem is refused naming ``where``)."""
    from diffnet.problems import get_problem, resolve

    cls = name if isinstance(name, type) else resolve(name)
    kwargs = dict(kwargs)
    if grid is not None:
        if len(grid) != cls.dims:
            raise ValueError(f"{where} {grid_text(grid)} has {len(grid)} axes, but problem "
                             f"{cls.name!r} has {cls.dims}: give {'x'.join('DHW'[-cls.dims:])}")
        kwargs["grid"] = list(grid)
    return get_problem(cls, **kwargs)


def training_grid(meta) -> list[int] | None:
    """The grid a checkpoint's network was trained on (from its metadata), or None: the grid
    of the level it was written in (a multigrid run's checkpoint mid-schedule), else the
    problem's grid."""
    try:
        return [int(v) for v in meta.get("grid") or meta["problem"]["kwargs"]["grid"]]
    except (KeyError, TypeError, ValueError):
        return None


def trained_config(meta, section: str) -> dict:
    """One ``[section]`` of the config a checkpoint was trained with (empty if not recorded)."""
    return (meta.get("config") or {}).get(section) or {}


AS_IS = ("as-is", "none")   # --work-grid spellings of "the network runs on the output grid"


def resolve_work_grid(text, meta) -> list[int] | None:
    """--work-grid 'HxW' or 'DxHxW' / 'trained' / 'as-is' (or 'none', or None) -> the grid /
    the training grid / None (the network runs on the output grid itself). The commands and
    ``deepfusion.load`` pass 'trained' when the user gives nothing; None stays 'as-is' for
    callers of :func:`load_model` that choose per call (the benchmarks' controls)."""
    t = "none" if text is None else str(text).strip().lower()
    if t in AS_IS:
        return None
    if t == "trained":
        grid = training_grid(meta)
        if grid is None:
            raise ValueError("--work-grid trained: the checkpoint does not record its training "
                             "grid; give --work-grid HxW, or --work-grid as-is")
        return grid
    try:
        return list(parse_grid(t))
    except ValueError:
        raise ValueError(f"--work-grid must be HxW (e.g. 64x64), DxHxW for a 3-D problem, "
                         f"'trained' or 'as-is', got {text!r}") from None


def trained_here(model, meta, grid) -> bool:
    """Whether the network answers on ``grid`` as trained: the training grid, or one of a grown
    (prolonged) network's chain of grids (``grids()``), each trained on its own level."""
    grids = [tuple(g) for g in model.grids()] if hasattr(model, "grids") else []
    return tuple(grid) in grids + [tuple(training_grid(meta) or ())]


def grid_note(model, meta, grid, work, explicit: bool) -> str | None:
    """What the user should know when the answer's grid is not the training grid: the network
    ran on its training grid and was interpolated (said when that was the default, not asked
    for), or it ran on another grid as is (what that costs). None when nothing changed."""
    trained = training_grid(meta)
    on = list(work.grid if work is not None else grid)
    if not trained or trained_here(model, meta, grid):
        return None
    if not trained_here(model, meta, on):
        how = "--work-grid as-is" if work is None else f"--work-grid {grid_text(on)}"
        return (f"the network was trained on {grid_text(trained)} and runs on "
                f"{grid_text(on)} ({how}): its filters and receptive field count nodes, so "
                f"on this grid they cover another physical extent and its error can be far "
                f"above the training error; check it (deepfusion compare) or run it on its "
                f"training grid with --work-grid trained")
    if explicit:
        return None
    return (f"the network was trained on {grid_text(trained)}: it runs there and its answer "
            f"is interpolated to {grid_text(grid)} (--work-grid trained, the default; "
            f"--work-grid as-is runs it on {grid_text(grid)} itself)")


def checkpoint_file(path: str, notes: list | None = None) -> str:
    """``path`` itself, or for a run directory its newest checkpoint that passes its check (the
    argument of ``infer`` and ``evaluate`` may be either). ``notes`` (a list, if given) gets
    ``(level, text)`` lines for the user, level "note" or "WARNING": which checkpoint of a run
    directory is used and why newer ones were skipped, and a file written without a seal."""
    from deepfusion.engine.checkpoint.store import find_checkpoint, seal_status, unsealed_note

    said = []
    if not os.path.isdir(path):
        if seal_status(path) == "unsealed":
            said.append(("WARNING", unsealed_note(path)))
        found = path
    else:
        unsealed = []
        found, skipped = find_checkpoint(path, unsealed)
        where = os.path.join(path, "checkpoints")
        if found is None:
            why = f" ({'; '.join(skipped)})" if skipped else ""
            raise ValueError(f"{path}: no complete checkpoint in {where}{why}")
        name = os.path.basename(found)
        if skipped:
            said.append(("WARNING", f"{path}: using {name}, the newest checkpoint in {where} "
                                    f"that passes its check; skipped the newer "
                                    + "; ".join(skipped)))
        else:
            said.append(("note", f"{path}: using its newest checkpoint, {name}"))
        said += [("WARNING", text) for text in unsealed]
    if notes is not None:
        notes += said
    return found


def load_model(path, grid=None, work_grid=None, options=None):
    """(model in eval mode, problem, work problem or None, meta) rebuilt from a checkpoint.

    ``problem`` is on ``grid`` (default: the training grid); with ``work_grid`` (the
    ``--work-grid`` text, see :func:`resolve_work_grid`; None here means as-is, the commands
    pass 'trained' by default) the network runs on the work problem's grid and its imposed
    output is interpolated to ``grid`` (see :func:`predictor`).
    ``options`` (``--set problem.options.KEY=VALUE``) replace problem options of the checkpoint, e.g. how
    the answer is formed from the network's output; the network must still fit the problem.
    """
    from diffnet.generators import build_generator

    from deepfusion.engine.checkpoint.store import load_checkpoint

    state = load_checkpoint(path)
    meta = state["meta"]
    try:
        spec_m, spec_p = meta["model"], meta["problem"]
        model = build_generator(spec_m["name"], **spec_m["kwargs"])
        model.load_state_dict(state["model_state"])
    except (KeyError, TypeError, RuntimeError) as e:
        raise ValueError(f"checkpoint {path} does not describe a usable model "
                         f"({type(e).__name__}: {e}); was it written by 'deepfusion train'?") from None
    dtype = next(iter(state["model_state"].values())).dtype
    model = model.to(dtype).eval()
    # default: the grid the network was trained on when the checkpoint was written
    cls = trained_problem(path, spec_p)
    problem = build_problem(cls, answer_options(cls, spec_p, options), grid or training_grid(meta))
    if options:
        check_fits(problem, spec_p, options)
    where = None if grid is None else f"--grid {grid_text(grid)}"
    return model, problem, work_problem(model, problem, meta, work_grid, where), meta


def trained_problem(path, spec: dict):
    """The Problem class a checkpoint's problem spec names (a registered name, 'module:Class'
    or 'entry-point:NAME': how training found it), or a ValueError naming the checkpoint."""
    from diffnet.problems import resolve

    try:
        return resolve(spec["name"])
    except ValueError as e:
        raise ValueError(f"checkpoint {path} was trained on problem {spec['name']!r}, which "
                         f"this process cannot find: {e}") from None


def answer_options(cls, spec: dict, options) -> dict:
    """The checkpoint's problem options with the ``--set`` ones in place (not the grid,
    which --grid sets); an option that names a preset (Problem.option_presets) brings the
    preset's values in place of the stored ones."""
    from diffnet.problems import replace_options

    options = dict(options or {})
    if "grid" in options:
        raise ValueError("problem.options.grid: give the grid with --grid HxW")
    return replace_options(cls, spec["kwargs"], options)  # the problem refuses unknown names


def check_fits(problem, spec: dict, options: dict) -> None:
    """ValueError when the ``--set`` problem options change the channels the network was
    built for."""
    from diffnet.problems import get_problem

    trained = get_problem(type(problem), **spec["kwargs"])
    for what in ("input_channels", "output_channels"):
        if getattr(problem, what) != getattr(trained, what):
            raise ValueError(f"{as_set_flags(options)} "
                             f"changes the problem's {what.replace('_', ' ')} "
                             f"({getattr(trained, what)} -> {getattr(problem, what)}), which "
                             f"the network was built for; change only options that keep them")


def work_problem(model, problem, meta, work_grid, where=None):
    """The problem on the grid the network runs on (None: ``problem``'s own grid), checked.

    ``work_grid`` is the ``--work-grid`` text; ``where`` says where ``problem``'s grid came from
    (e.g. "--grid 18x18" or "--inputs f.h5"), for the message. Raises ValueError naming the
    grid and the nearest sizes the network takes when it cannot run there.
    """
    wg = resolve_work_grid(work_grid, meta)
    if str(work_grid).strip().lower() == "trained" and trained_here(model, meta, problem.grid):
        wg = None   # a grown network answers as trained on each grid of its chain
    work = None if wg is None or list(wg) == list(problem.grid) else build_problem(
        type(problem), problem.config(), wg, where="--work-grid")
    on = work or problem
    probe = torch.zeros((1, len(problem.input_channels), *on.grid),
                        dtype=next(model.parameters()).dtype)
    try:
        model.check_input(probe) if hasattr(model, "check_input") else None
    except ValueError as e:
        if work is not None:
            raise ValueError(f"--work-grid {grid_text(on.grid)}: {e}") from None
        where = where or f"--grid {grid_text(on.grid)}"
        raise ValueError(f"{where}: {e}; a network trained on another grid can run on it "
                         f"with --work-grid trained") from None
    return work


# ---------------------------------------------------------------------------------------------
# distributed execution
# ---------------------------------------------------------------------------------------------

def rank_batches(n: int, batch: int, rank: int, size: int) -> list[tuple[int, int]]:
    """This rank's (lo, hi) batches: global batches of ``batch`` samples, contiguous per rank."""
    nb = math.ceil(n / batch)
    first, last = rank * nb // size, (rank + 1) * nb // size
    return [(k * batch, min(n, (k + 1) * batch)) for k in range(first, last)]


def warmup_pays(n: int, batch: int, units: int) -> bool:
    """Whether an untimed warm-up forward pays: only if some rank (or domain group) runs more
    than one batch. With one batch each (e.g. one huge field) it would double the wall time
    only to keep kernel selection out of the timing, so the timing then includes it."""
    return n > batch * units


def run_blocks(comm, n: int, batch: int, compute, writer, domain=None) -> float:
    """Compute every batch on its rank, rank 0 writes; returns compute seconds summed over
    ranks (on every rank). ``compute(lo, hi) -> (u (b, *grid), inputs (b, C, *grid),
    seconds[, per-sample records {name: (b,)}])``. Under a domain split (``domain``) the
    batches go to the groups, every rank of a group computes them together and ``compute``
    returns u = None except on the group's first rank."""
    unit, units = (domain.group, domain.groups) if domain else (comm.rank, comm.size)
    plan = rank_batches(n, batch, unit, units)
    rounds = max(len(rank_batches(n, batch, r, units)) for r in range(units))
    busy = 0.0
    for k in range(rounds):
        item = None
        if k < len(plan):
            lo, hi = plan[k]
            u, x, sec, *records = compute(lo, hi)
            busy += sec
            item = (lo, u, x, *records) if u is not None else None
        items = comm.gather_obj(item)
        if writer is not None:
            for it in items:
                if it is not None:
                    writer.write(*it)
        del items
    return float(sum(comm.allgather_obj(busy)))


def predictor(model, problem, samples: Samples, *, channels_last: bool = False, work=None,
              domain=None, warmup: bool = True, post=None, refine=None, check: bool = False):
    """compute(lo, hi) for run_blocks: the prediction pipeline (``deepfusion.engine.predict.pipeline``)
    on one batch, timed from the inputs on the work grid to the answer on the output grid (the
    inputs recorded on the output grid are built outside the time).

    ``work``: the same problem on the grid the network runs on (see :func:`work_problem`);
    ``domain``: the split, the model and ``work or problem`` on its block, u = None except on
    the group's first rank; ``post``: the pipeline's per-batch post-step. With ``warmup``
    every new batch size first runs once untimed (one-off kernel selection stays out of the
    timing). ``refine`` (a tolerance): each answer is then refined by the problem's reference
    solver (``deepfusion.engine.predict.refine``), outside the time, and returned in float64 with its
    per-sample records. ``check``: each answer written gets its residual and flag
    (``Problem.check_answers``, outside the time) among its records.
    """
    from deepfusion.engine.predict.pipeline import Pipeline
    from deepfusion.engine.predict.refine import refine_batch

    pipe = Pipeline(model, problem, work=work, channels_last=channels_last, domain=domain,
                    post=post)
    warm: set = set()

    @torch.inference_mode()
    def compute(lo, hi):
        x = pipe.record(samples, lo, hi)
        if warmup and hi - lo not in warm:  # a new shape pays one-off kernel selection
            pipe.answer_batch(samples, lo, hi, x)
            warm.add(hi - lo)
        t0 = time.perf_counter()
        b = pipe.answer_batch(samples, lo, hi, x)
        sec = time.perf_counter() - t0
        if b.u is None:
            return None, None, sec
        if refine is not None:
            u, records = refine_batch(problem, b.u, samples.inputs(problem, lo, hi,
                                                                   torch.float64), refine)
        else:
            u, records = b.u.float().contiguous().numpy(), {}
        if check:
            records.update(problem.check_answers(u, samples.inputs(problem, lo, hi,
                                                                   torch.float64)))
        return (u, b.inputs.float().numpy(), sec) + ((records,) if records else ())
    return compute


def make_solver(problem, samples: Samples, method: str = "auto"):
    """solve(j) -> (*grid) reference solution of sample j, from its fields or its parameters.

    The method, and whether the problem solves from given fields at all, are checked here,
    before any solve (``Problem.check_method``), so a bad choice fails up front on every rank.
    """
    from diffnet.problems import check_reference

    check_reference(problem, "'deepfusion solve' has no solver to run")
    from_fields = samples.fields is not None
    problem.check_method(method, from_inputs=from_fields)
    if from_fields:
        return lambda j: problem.solve_from_inputs(samples.fields[j], method)
    return lambda j: problem.reference_solution(samples.params[j], method)


def solver_compute(problem, samples: Samples, solve):
    """compute(lo, hi) for run_blocks: the reference solutions (solver calls timed)."""
    def compute(lo, hi):
        x = samples.inputs(problem, lo, hi, torch.float64)
        t0 = time.perf_counter()
        u = np.stack([solve(j) for j in range(lo, hi)])
        sec = time.perf_counter() - t0
        return u.astype(np.float32), x.numpy().astype(np.float32), sec
    return compute


def open_writer(path, problem, samples: Samples, refined: bool = False,
                checked: bool = False) -> h5io.FieldWriter:
    """The output file's writer (rank 0 only), sized for all samples; ``refined``: float64
    answers and the refinement's per-sample records (``deepfusion.engine.predict.refine``);
    ``checked``: the answers' residuals and flags (``h5io.CHECK_DATASETS``)."""
    from deepfusion.engine.predict.refine import DATASETS

    axes = [a.name for a in problem.axes]
    names = list(problem.param_names) if samples.params.shape[1] else []
    extra = {name: dtype for name, (dtype, _) in DATASETS.items()} if refined else {}
    extra.update(h5io.CHECK_DATASETS if checked else {})
    return h5io.FieldWriter(path, n=samples.n, grid=problem.grid,
                            channels=problem.input_channels, params=samples.params,
                            param_names=names, coords=problem.coords(), axes=axes,
                            u_dtype="float64" if refined else "float32", extra=extra)
