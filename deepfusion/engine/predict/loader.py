"""A checkpoint loaded for prediction, the first step of the prediction service
(:mod:`.service`): the checkpoint file (a run directory's newest one that passes its check),
the network in eval mode, the problem on the output grid, the problem on the grid the network
runs on (the work grid), the checkpoint's metadata, and what the user should be told about
them, as data (:class:`Loaded`): the caller prints it once (rank 0) or warns.

The grids: the answer is asked on the output grid (default: the training grid); the network
runs on the work grid, by default ('trained') its training grid, and its answer is
interpolated to the output grid. 'as-is' runs it on the output grid itself, which changes
the physical extent its filters cover (:func:`grid_note` says what that costs). Problem options
given with the command (``--set problem.options.KEY=VALUE``) replace the checkpoint's, as long
as the network still fits the problem (:func:`check_fits`).

Kept light on imports: torch comes in with the first load, after the commands set their
thread layout.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from deepfusion.config import DataConfig
from deepfusion.config.files import as_set_flags

AS_IS = ("as-is", "none")   # --work-grid spellings of "the network runs on the output grid"


# ---------------------------------------------------------------------------------------------
# grids and problems
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


def problem_from_spec(name, kwargs: dict, grid=None, where: str = "--grid"):
    """The problem of a stored spec: ``name`` (a registered name, 'module:Class', a plugin's
    entry point, or a Problem class) with options ``kwargs`` (a checkpoint's, a command's), its
    grid replaced by ``grid`` if given (one with
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


def work_problem(model, problem, meta, work_grid, where=None):
    """The problem on the grid the network runs on (None: ``problem``'s own grid), checked.

    ``work_grid`` is the ``--work-grid`` text; ``where`` says where ``problem``'s grid came from
    (e.g. "--grid 18x18" or "--inputs f.h5"), for the message. Raises ValueError naming the
    grid and the nearest sizes the network takes when it cannot run there.
    """
    import torch

    wg = resolve_work_grid(work_grid, meta)
    if str(work_grid).strip().lower() == "trained" and trained_here(model, meta, problem.grid):
        wg = None   # a grown network answers as trained on each grid of its chain
    work = None if wg is None or list(wg) == list(problem.grid) else problem_from_spec(
        type(problem), problem.config(), wg, where="--work-grid")
    on = work or problem
    check_channels(model, problem)
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


def check_channels(model, problem) -> None:
    """ValueError when the problem now builds another number of input channels than the
    checkpoint's network takes: the problem's code changed since training (a plugin edited),
    which no grid or work grid can mend."""
    config = model.config() if hasattr(model, "config") else {}
    trained = config.get("in_channels")
    now = list(problem.input_channels)
    if trained is None or int(trained) == len(now):
        return
    raise ValueError(f"the checkpoint's network takes {trained} input channel(s), but problem "
                     f"{problem.name!r} now builds {len(now)}, {now}: its code changed since "
                     f"the network was trained (not the grid). Run the problem's code as it was "
                     f"when trained, or retrain with the problem as it is now")


# ---------------------------------------------------------------------------------------------
# the checkpoint
# ---------------------------------------------------------------------------------------------

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
    output is interpolated to ``grid`` (:class:`~deepfusion.engine.predict.pipeline.Pipeline`).
    ``options`` (``--set problem.options.KEY=VALUE``) replace problem options of the checkpoint,
    e.g. how the answer is formed from the network's output; the network must still fit the
    problem.
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
    problem = problem_from_spec(cls, answer_options(cls, spec_p, options), grid or training_grid(meta))
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
    given = as_set_flags(options)
    for what in ("input_channels", "output_channels"):
        if getattr(problem, what) != getattr(trained, what):
            raise ValueError(f"{given} "
                             f"changes the problem's {what.replace('_', ' ')} "
                             f"({getattr(trained, what)} -> {getattr(problem, what)}), which "
                             f"the network was built for; change only options that keep them")


@dataclass
class Loaded:
    """A checkpoint loaded for prediction (:func:`load`). ``notes``: ``(level, text)`` lines
    for the user, level "note" or "WARNING", in the order to say them: which checkpoint of a
    run directory is used, a file written without a seal."""

    path: str
    model: object
    problem: object
    work: object
    meta: dict
    notes: list = field(default_factory=list)

    def trained(self, section: str) -> dict:
        """One ``[section]`` of the config the checkpoint was trained with."""
        return trained_config(self.meta, section)

    @property
    def channels_last(self) -> bool:
        """Whether the network was trained channels-last (its inputs are given so)."""
        return bool(self.trained("model").get("channels_last", False))

    @property
    def correction(self) -> int:
        """The cells of the coarse correction the run answers with (0: none, or a run from
        before the setting)."""
        return int(self.trained("problem").get("correction", 0))

    @property
    def step(self) -> int:
        return int(self.meta.get("step", -1))

    def grid_note(self, explicit: bool, problem=None, work=None) -> str | None:
        """:func:`grid_note` for the output grid of ``problem`` (default: the loaded one) and
        the work problem ``work`` (default: the loaded one, with the loaded problem)."""
        if problem is None:
            problem, work = self.problem, self.work
        return grid_note(self.model, self.meta, problem.grid, work, explicit)

    def seed_notes(self, seed: int, *, held_out: bool = False,
                   keep_test: bool = False) -> list[str]:
        """WARNING texts when draws of ``seed`` are not unseen inputs: the training seed
        (data.seed); for a held-out evaluation (``held_out``, the seeds of data's defaults
        where the checkpoint records none) also the validation draw (data.eval_seed) the run
        was tuned on; for a calibration (``keep_test``: it must leave the test draw unseen)
        the test draw (data.test_seed) too."""
        if not (held_out or keep_test):
            data_seed = self.trained("data").get("seed")
            if data_seed is not None and seed == data_seed:
                return [f"--seed {seed} is the training seed (data.seed): these samples are the "
                        f"training pool, not unseen inputs"]
            return []
        data = self.data()
        if seed == data["seed"]:
            return [f"--seed {seed} is the training seed (data.seed): these are training samples"]
        if seed == data["eval_seed"]:
            return [f"--seed {seed} is the validation draw (data.eval_seed) the run was tuned on, "
                    f"not an unseen test draw"]
        if keep_test and seed == data["test_seed"]:
            return [f"--seed {seed} is the test draw (data.test_seed): calibrated on it, the "
                    f"test no longer measures unseen answers"]
        return []

    def data(self) -> dict:
        """The run's ``[data]`` section, defaults filled in where the checkpoint records none."""
        return {**vars(DataConfig()), **self.trained("data")}


def load(path, *, grid=None, work_grid=None, options=None, notes: list | None = None) -> Loaded:
    """A checkpoint file, or a run directory's newest complete checkpoint, loaded for
    prediction on ``grid`` (default: the training grid) with the network on ``work_grid``
    (:func:`resolve_work_grid`; None: as-is) and the problem options ``options``. ValueError
    for anything refused (no checkpoint, not a usable one, options that do not fit).
    ``notes``: the list the notes go to as they are found (then ``Loaded.notes``), so a caller
    that reports a refusal can say which checkpoint it was."""
    notes = [] if notes is None else notes
    given, path = str(path), checkpoint_file(str(path), notes)
    model, problem, work, meta = load_model(path, grid, work_grid=work_grid, options=options)
    if os.path.isdir(given):
        check_own_run(given, path, meta)
    return Loaded(path, model, problem, work, meta, notes)


def check_own_run(run_dir: str, path: str, meta: dict) -> None:
    """ValueError where a run directory's checkpoint was written by another run (a copied
    file): answers are the run's own, or the file is named on purpose."""
    from deepfusion.engine.run.identity import other_run

    ids = other_run(run_dir, meta)
    if ids:
        ours, theirs = ids
        raise ValueError(f"{run_dir}: {path} was written by another run (id {theirs}), not by "
                         f"this one (id {ours}): remove that file to answer with the run's own "
                         f"checkpoints, or give the file itself ({path}) to answer with it")
