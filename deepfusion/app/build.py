"""Building a run from a configuration: check everything, then create the run directory.
``build_checked`` is the sequence of builds and checks, shared by ``train`` and ``check``.

The order is the contract: the config, then (``preflight``, before torch is imported) the
batch against the number of ranks, the precision against this CPU and the run directory's
state, then the problem and the generator on the problem's grid are all checked (on every
rank, status exchanged) before anything is written, so a refused command leaves no trace and
the corrected one is not refused as "already holds a run".
Problems and generators are reached through diffnet's registries by name only.
"""
from __future__ import annotations

import copy
import os

import torch

from diffnet.generators import build_generator
from diffnet.kernels import KernelUnavailable, fusable, fuse
from diffnet.split_layers import check_generator_split
from diffnet.problems import available_text, get_problem, problem_spec, resolve

from deepfusion.config import dump_toml
from deepfusion.engine.checkpoint.store import CheckpointError, load_checkpoint
from deepfusion.engine.train.plan import plan
from deepfusion.engine.train.resuming import load_newest
from deepfusion.engine.parallel.memformat import convert_model
from deepfusion.engine.run.files import clear_run_dir
from deepfusion.engine.run.identity import ensure_run_id
from deepfusion.engine.run.resume import check_own, resume_refusal
from deepfusion.app.preflight import holds_run
from deepfusion.app.problems import check_registry_options


def build_checked(cfg, check):
    """(problem, network, specs, problems of every level) of ``cfg``, every step checked in
    ``train``'s order: the options against the registries, the problem, the network against
    every grid it trains on, each level's problem, and each rank's block of a domain split.
    ``check(fn, *args, per_rank=False)`` runs one step on every rank and raises the refusal
    (``train``: collective_check on the job's ranks; ``deepfusion check``: the ranks of the
    job it checks, simulated in one process); ``per_rank`` steps take the rank last."""
    check(check_registry_options, cfg)
    problem = check(build_problem, cfg)
    model, specs = check(build_model, cfg, problem)
    problems = check(problem_factory, cfg, problem)
    check(check_splits, cfg, problems, per_rank=True)
    check(check_answer_correction, cfg, problem)
    return problem, model, specs, problems


def check_answer_correction(cfg, problem) -> None:
    """``problem.correction`` tried on one answer of the problem (its loss must be quadratic,
    the cells must fit the grid): refused before training, not at the first validation."""
    from diffnet.problems import check_correction

    try:
        check_correction(problem, cfg.problem.correction)
    except ValueError as e:
        raise ValueError(f"problem.correction = {cfg.problem.correction}: {e}") from None


def torch_dtype(cfg) -> torch.dtype:
    return torch.float64 if cfg.train.dtype == "float64" else torch.float32


def build_problem(cfg, grid=None):
    """The problem of ``[problem]`` on ``grid`` (default ``problem.grid``; a multigrid level
    asks for its own). ``problem.name`` is a registered name, 'module:Class' or a plugin's
    entry point (diffnet.problems.resolve); the registry lists valid names and options."""
    if not cfg.problem.name:
        raise ValueError(f"problem.name is not set ([problem] name = ... in the config, or "
                         f"--set problem.name=...): {available_text()}")
    grid = tuple(cfg.problem.grid if grid is None else grid)
    try:
        cls = resolve(cfg.problem.name)
    except ValueError as e:
        raise ValueError(f"problem.name: {e}") from None
    return get_problem(cls, grid=grid, **cfg.problem.options)


def problem_factory(cfg, problem):
    """grid -> the problem on that grid (``problem`` itself on ``problem.grid``). The problems of
    every level are built here, so a grid the problem refuses is reported before training,
    with the level named."""
    made = {tuple(problem.grid): problem}
    for v in plan(cfg):
        if v.grid not in made:
            try:
                made[v.grid] = build_problem(cfg, v.grid)
            except ValueError as e:
                raise ValueError(f"train.levels[{v.level}].grid = {list(v.grid)}: {e}") from None
    return lambda grid: made[tuple(grid)]


def build_model(cfg, problem):
    """(generator, specs): initialised from ``train.init_seed`` (or ``model.init_from``), checked
    against the problem's grid; ``specs`` rebuild generator and problem from a checkpoint."""
    check_domain(cfg)
    torch.manual_seed(cfg.train.init_seed)
    kwargs = {"in_channels": len(problem.input_channels), "out_channels": problem.output_channels,
              **cfg.model.options}
    if kwargs["out_channels"] != problem.output_channels:
        raise ValueError(f"model.options.out_channels = {kwargs['out_channels']}, but problem "
                         f"{problem.name!r} takes {problem.output_channels} output field(s) from "
                         f"the network with its options; remove model.options.out_channels")
    model = build_generator(cfg.model.name, **kwargs).to(torch_dtype(cfg))
    check_grids(model, cfg, problem, model_grower(cfg, problem))
    if cfg.model.init_from:
        init_from(model, cfg.model.name, cfg.model.init_from)
    model = fuse_kernels(convert_model(model, cfg.model.channels_last), cfg)
    specs = {"model": {"name": cfg.model.name, "kwargs": model.config()},
             # the name that finds the problem again in a new process: a registered name,
             # 'module:Class' or 'entry-point:NAME' (diffnet.problems.problem_spec)
             "problem": {"name": problem_spec(type(problem)), "kwargs": problem.config()}}
    return model, specs


def fuse_kernels(model, cfg):
    """``model`` with the compiled kernels (norm + GELU, upsampling + concatenation, Winograd
    convolutions) in place of their eager modules when ``train.fused_kernels`` is set (in place,
    returned); a host that cannot build them is refused with the reason and the fix."""
    if cfg.train.fused_kernels:
        if cfg.train.compile:
            raise ValueError("train.fused_kernels = true with train.compile = true: both fuse "
                             "the step's elementwise work; set one of them to false")
        try:
            fuse(model)
        except KernelUnavailable as e:
            raise ValueError(f"train.fused_kernels = true: {e}") from None
    return model


def fused_kernels_hint(cfg, model, precision: str) -> str:
    """The start-up note that ``train.fused_kernels`` would take this run's step, which runs
    without it; "" where the kernels would not apply (bf16, float64, NCHW, 3-D, a split domain,
    torch.compile) or are already on. Builds nothing: a host without GCC learns of it only if
    it turns the option on."""
    if (cfg.train.fused_kernels or cfg.train.compile or cfg.parallel.blocks() > 1
            or precision != "fp32" or cfg.train.dtype != "float32"
            or not cfg.model.channels_last or len(cfg.problem.grid) != 2 or not fusable(model)):
        return ""
    return ("fused kernels: off; train.fused_kernels = true runs this step 1.3-1.6x faster on "
            "the hosts measured, at a different float32 rounding (needs GCC; "
            "docs/performance.md, \"Fused kernels\")")


def model_grower(cfg, problem):
    """grow(module, visit) -> (module, spec): the network so far prolonged to the visit's grid
    (a level with ``prolong``; :class:`diffnet.generators.Prolonged`, options
    ``model.prolong`` with the level's ``correction`` over them). Deterministic: the new
    weights come from ``train.init_seed`` and the visit, outside the global RNG stream, so a
    resumed or rolled-back run regrows the same."""
    def grow(module, visit):
        with torch.random.fork_rng():
            torch.manual_seed(cfg.train.init_seed + 7919 * (visit.index + 1))
            grown = build_generator("prolonged", inner=module, inner_grid=visit.inner_grid,
                                    grid=visit.grid, in_channels=len(problem.input_channels),
                                    out_channels=problem.output_channels,
                                    correction=visit.correction,
                                    train_inner=visit.train_inner)
        grown = fuse_kernels(convert_model(grown.to(torch_dtype(cfg)), cfg.model.channels_last),
                             cfg)
        return grown, {"name": "prolonged", "kwargs": grown.config()}
    return grow


def first_grid(cfg) -> tuple[int, ...]:
    """The grid training starts on (the first level's; ``problem.grid`` without levels): where
    the network as built is split first (a grown network's first network need not suit the
    finest grid)."""
    return tuple(plan(cfg)[0].grid)


def check_grids(model, cfg, problem, grow) -> None:
    """Every grid the run trains on suits the network it trains there (divisibility by
    2**depth, norms; a prolonged level's network as grown)."""
    grids = [("problem.grid", list(problem.grid), model)] if not cfg.train.levels else []
    visits = plan(cfg)
    if any(v.grows for v in visits):  # grow a copy: growing may freeze the network it wraps
        model = copy.deepcopy(model)
    for v in visits:
        key = f"train.levels[{v.level}]"
        if v.grows:
            try:
                model = grow(model, v)[0]
            except ValueError as e:
                raise ValueError(f"{key}.prolong: the correction network (model.prolong with "
                                 f"{key}.correction over it: {v.correction}): {e}") from None
        grids.append((f"{key}.grid", list(v.grid), model))
    split = cfg.parallel.domain if cfg.parallel.blocks() > 1 else None
    for key, grid, net in grids:
        probe = torch.zeros((1, len(problem.input_channels), *grid), dtype=torch_dtype(cfg))
        try:
            net.check_input(probe)
            if split:
                check_generator_split(net, grid, split)
        except ValueError as e:
            k = cfg.train.coarse_to_fine
            why = (f" (train.coarse_to_fine = {k} wrote this level: use fewer levels, or a "
                   f"shallower network)" if k >= 2 else "")
            raise ValueError(f"{key} = {grid} does not suit model {cfg.model.name!r} "
                             f"{cfg.model.options}: {e}{why}") from None


def check_splits(cfg, problems, rank: int) -> None:
    """ValueError, before the run directory is made, when the problem of a visit's grid cannot
    compute its loss on this rank's block of ``parallel.domain`` (its ``check_split_block``, e.g.
    a user's problem written for the whole grid only), with the problem's reason."""
    import math

    import numpy as np

    from diffnet.domain import Block

    split = [int(s) for s in cfg.parallel.domain]
    if cfg.parallel.blocks() <= 1:
        return
    # the rank's place in its domain group: groups are consecutive ranks (halo.domain_groups)
    index = np.unravel_index(rank % math.prod(split), split)
    for grid in sorted({tuple(v.grid) for v in plan(cfg)}):
        shape = [int(g) // s for g, s in zip(grid, split)]
        block = Block(grid, [int(i) * n for i, n in zip(index, shape)], shape)
        try:
            problems(grid).check_split_block(block)
        except ValueError as e:
            raise ValueError(f"parallel.domain = {split}: {e}") from None


def check_domain(cfg) -> None:
    """What a domain split (parallel.domain) cannot be combined with, refused up front."""
    if cfg.parallel.blocks() <= 1:
        return
    if cfg.train.compile:
        raise ValueError(f"train.compile = true with parallel.domain = {cfg.parallel.domain}: "
                         f"the halo exchange is MPI inside autograd, which torch.compile cannot "
                         f"trace; set train.compile = false or parallel.domain = []")
    if cfg.train.fused_kernels:
        raise ValueError(f"train.fused_kernels = true with parallel.domain = "
                         f"{cfg.parallel.domain}: the fused norm takes its statistics over one "
                         f"block, not the whole field; set train.fused_kernels = false or "
                         f"parallel.domain = []")


def init_from(model, name: str, path: str) -> None:
    """Copy the generator weights of checkpoint ``path`` into ``model`` (model.init_from)."""
    state = load_checkpoint(path)
    differs = network_mismatch(model, name, state["meta"])
    if differs:
        raise ValueError(f"model.init_from = {path!r} {differs}; set [model] name and options "
                         f"to match it, or start from scratch with model.init_from = \"\"")
    dtype = next(model.parameters()).dtype
    model.load_state_dict({k: v.to(dtype) for k, v in state["model_state"].items()})


def network_mismatch(model, name: str, meta: dict, *, grown: bool = False) -> str:
    """How the generator a checkpoint's ``meta`` records differs from ``model`` (built as
    ``name``), "" if it does not. ``grown``: a network grown from ``model`` (a resume past a
    prolonged level, which grows the built network again) counts as ``model``."""
    spec = meta.get("model") or {}
    while grown and "inner" in (spec.get("kwargs") or {}):
        spec = spec["kwargs"]["inner"]
    ours, theirs = model.config(), spec.get("kwargs")

    def arch(kwargs):  # checkpoint_levels changes memory, not the weights
        return {k: v for k, v in kwargs.items() if k != "checkpoint_levels"}

    if spec.get("name") != name or (theirs is not None and arch(theirs) != arch(ours)):
        return (f"holds generator {spec.get('name')!r} {theirs}, but this run builds "
                f"{name!r} {ours}")
    return ""


def check_resume(cfg, model, rank: int):
    """``--resume``: the run directory's newest checkpoint belongs to this run and holds the
    network this config builds. Rank 0 reads it (and returns its read, ``load_newest``'s, for
    the trainer to resume from; None on the other ranks); checked before anything of the run
    is written, so a refused resume leaves the run as it was."""
    if rank != 0:
        return None
    d = cfg.run.dir
    try:
        found = load_newest(d)
    except CheckpointError as exc:
        raise resume_refusal(d, exc) from None
    path, meta = found[0], found[1]["meta"]
    check_own(d, path, meta)
    refuse_new_start(cfg, meta, d)
    differs = network_mismatch(model, cfg.model.name, meta, grown=True)
    if differs:
        raise ValueError(f"--resume {d}: its checkpoint {os.path.basename(path)} {differs}: a "
                         f"resume continues the same network. Drop the --set of model.name or "
                         f"model.options (or put them back in the config); to train another "
                         f"network from these weights, start a new run in another directory")
    return found


def refuse_new_start(cfg, meta: dict, d: str) -> None:
    """ValueError where a resume's settings would make another run of it: another problem, or
    other weights to start from (``model.init_from``)."""
    saved = meta.get("config") or {}
    was = (saved.get("problem") or {}).get("name")
    if was and was != cfg.problem.name:
        raise ValueError(f"--resume {d}: the run solves problem {was!r}, this config "
                         f"{cfg.problem.name!r}: a resume continues the same PDE. Drop the "
                         f"--set of problem.name; to train on {cfg.problem.name!r} from these "
                         f"weights, start a new run with --set model.init_from=CHECKPOINT "
                         f"--set run.dir=NEW_DIR")
    started = (saved.get("model") or {}).get("init_from", "")
    if cfg.model.init_from and cfg.model.init_from != started:
        raise ValueError(f"--resume {d}: model.init_from = {cfg.model.init_from!r} starts a run "
                         f"from other weights, and a resume continues this run's own. Drop "
                         f"the --set of model.init_from, or start a new run from those "
                         f"weights with --set run.dir=NEW_DIR")


def prepare_run_dir(cfg, resume: bool, overwrite: bool, rank: int) -> None:
    """Create (or empty, with --overwrite) the run directory and write the resolved config;
    rank 0 only, and only after ``preflight.check_run`` and the builds passed on every rank."""
    if rank != 0:
        return
    d = cfg.run.dir
    if overwrite and not resume and holds_run(d):
        clear_run_dir(d)  # all but the lock this job holds
    os.makedirs(os.path.join(d, "checkpoints"), exist_ok=True)
    ensure_run_id(d)  # a new run's identity; one of an earlier version takes one now
    with open(os.path.join(d, "config.toml"), "w") as f:
        f.write(dump_toml(cfg))
