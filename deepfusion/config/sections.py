"""The configuration sections: one ``@dataclass(kw_only=True)`` per TOML table.

``[problem]``, ``[model]``, ``[data]``, ``[optim]``, ``[train]``, ``[parallel]``, ``[run]``,
gathered in :class:`Config`. Every field carries its help text (``option(default, help)``);
every check lives in ``__post_init__`` so a config built in Python is validated exactly like
one read from a file, and every error is a :class:`ConfigError` naming the dotted key and the
fix. Reading files and overrides is :mod:`deepfusion.config.files`.

Pure Python: no PDE, no model, no MPI and no hardware probing (whether the CPU can run bf16
is decided by the engine when the run is built).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from deepfusion.config.levels import CYCLES, check_levels
from deepfusion.config.plans import budget_seconds, expand_coarse_to_fine
from deepfusion.config.schema import ConfigError, Section, describe_value, option, unknown_key


# ---------------------------------------------------------------------------------------------
# the sections
# ---------------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class ProblemConfig(Section):
    """[problem]: which parametric PDE family to solve, on which node grid."""

    _section: ClassVar[str] = "problem"

    name: str = option("", "PDE family from diffnet's problem registry (required: an unset or "
                           "unknown name is refused with the list of valid names)")
    grid: list[int] = option([64, 64], "node grid [H, W] (a 3-D problem: [D, H, W]), boundary "
                                       "nodes included; >= 4 per axis",
                         item_ge=4, min_len=1, max_len=3)
    options: dict[str, Any] = option({}, "problem-specific keyword arguments passed to the problem "
                                     "constructor (validated there), e.g. {c_range = [3, 6]}")
    correction: int = option(0, "the coarse correction every answer gets (validation, evaluate, "
                                "infer, the Python API; not the training loss): the minimiser of "
                                "the training loss over the answer's rescalings and the coarse "
                                "hats of a partition of this many cells per axis, for a linear "
                                "PDE with a quadratic loss (docs/coarse-correction.md); 0 = off",
                             ge=0)

    def _validate(self):
        if "grid" in self.options:
            raise ConfigError("problem.options.grid is not allowed: set problem.grid instead",
                              key="problem.options.grid")


@dataclass(kw_only=True)
class ModelConfig(Section):
    """[model]: the generator network."""

    _section: ClassVar[str] = "model"

    name: str = option("unet", "registered generator architecture")
    options: dict[str, Any] = option({}, "generator keyword arguments, e.g. {depth = 4, base_width = 32}")
    channels_last: bool = option(True, "use the channels-last memory format (NHWC on 2-D grids, "
                                       "NDHWC on 3-D grids; faster oneDNN convs)")
    init_from: str = option("", "checkpoint whose generator weights start this run (warm start, e.g. "
                            "coarse-to-fine from a coarser grid); its step and optimiser state are "
                            "not taken; same generator architecture required; empty = random init")
    prolong: dict[str, Any] = option({}, "options of the correction network a level with "
                                         "prolong = true adds (a U-Net: {depth = 3, "
                                         "base_width = 16, max_width = 64} by default)")

    def _validate(self):
        if not self.name.strip():
            raise self._err("name", "must be a non-empty model name, e.g. \"unet\"")


@dataclass(kw_only=True)
class DataConfig(Section):
    """[data]: the parameter-sample pool (DiffNet is data-free: samples are PDE parameters)."""

    _section: ClassVar[str] = "data"

    n_samples: int = option(256, "size N_s of the training pool of parameter samples", ge=1)
    seed: int = option(0, "seed of the training pool draw", ge=0)
    global_batch: int = option(32, "samples per optimiser step over ALL ranks (split across ranks)",
                           ge=1)
    eval_samples: int = option(16, "held-out parameter draws used for evaluation", ge=0)
    eval_seed: int = option(12345, "seed of the validation draw (evaluated during and at the "
                                   "end of training; the draw recipes are tuned on); must differ "
                                   "from data.seed", ge=0)
    test_samples: int = option(64, "draws of the test set reported by 'deepfusion evaluate'",
                               ge=1)
    test_seed: int = option(271828, "seed of the test draw, never looked at while tuning; must "
                                    "differ from data.seed and data.eval_seed", ge=0)

    def _validate(self):
        if self.n_samples < self.global_batch:
            raise self._err("n_samples", f"must be >= data.global_batch ({self.global_batch}), "
                                         f"got {self.n_samples}; enlarge the pool or shrink "
                                         f"the batch")
        if self.eval_seed == self.seed:
            raise self._err("eval_seed", f"must differ from data.seed (both are {self.seed}), "
                                         f"otherwise the held-out set repeats training samples")
        if self.test_seed in (self.seed, self.eval_seed):
            raise self._err("test_seed", f"must differ from data.seed ({self.seed}) and "
                                         f"data.eval_seed ({self.eval_seed}): the test draw is "
                                         f"never trained or tuned on")


@dataclass(kw_only=True)
class OptimConfig(Section):
    """[optim]: optimiser and learning-rate schedule."""

    _section: ClassVar[str] = "optim"

    name: str = option("adam", "optimiser (lamb: layer-wise adaptive Adam for large batches)",
                       choices=("adam", "sgd", "lamb", "lbfgs"))
    lr: float = option(1e-3, "peak learning rate (lamb: relative, each parameter tensor moves "
                             "by lr x its norm per step)", gt=0.0)
    weight_decay: float = option(0.0, "weight decay: L2 (added to the gradient) for adam/sgd, "
                                      "decoupled (in the update) for lamb", ge=0.0)
    betas: list[float] = option([0.9, 0.999], "Adam/LAMB (beta1, beta2), each in [0, 1)",
                            min_len=2, max_len=2, item_ge=0.0)
    momentum: float = option(0.9, "SGD momentum, in [0, 1)", ge=0.0, lt=1.0)
    schedule: str = option("cosine", "learning-rate schedule after warm-up",
                       choices=("constant", "cosine", "step", "exponential"))
    warmup_steps: int = option(0, "linear warm-up steps from 0 to optim.lr", ge=0)
    min_lr: float = option(0.0, "floor of the learning rate (cosine end value)", ge=0.0)
    step_size: int = option(1000, "steps between decays (schedule = \"step\")", ge=1)
    gamma: float = option(0.5, "decay factor (step: per step_size; exponential: per step), in (0, 1]",
                      gt=0.0, le=1.0)
    grad_clip: float = option(0.0, "clip the global gradient norm to this value; 0 = off", ge=0.0)
    lbfgs_history: int = option(20, "L-BFGS history size", ge=1)
    lbfgs_max_iter: int = option(20, "L-BFGS iterations per optimiser step", ge=1)
    lbfgs_tolerance_grad: float = option(1e-9, "L-BFGS first-order optimality tolerance", ge=0.0)
    lbfgs_tolerance_change: float = option(1e-12, "L-BFGS function/parameter change tolerance",
                                       ge=0.0)
    lbfgs_line_search: str = option("strong_wolfe", "L-BFGS line search",
                                choices=("strong_wolfe", "none"))
    switch_to_lbfgs_epoch: int = option(-1, "switch from adam/sgd/lamb to L-BFGS at this epoch; "
                                            "-1 = never",
                                    ge=-1)

    def _validate(self):
        for i, b in enumerate(self.betas):
            if not b < 1.0:
                raise ConfigError(f"optim.betas[{i}] must be in [0, 1), got {b!r}",
                                  key="optim.betas")
        if self.min_lr > self.lr:
            raise self._err("min_lr", f"must be <= optim.lr ({self.lr}), got {self.min_lr}")
        if self.switch_to_lbfgs_epoch >= 0 and self.name == "lbfgs":
            raise self._err("switch_to_lbfgs_epoch",
                            "only applies when optim.name is 'adam', 'sgd' or 'lamb' (it is "
                            "already 'lbfgs'); set it to -1")


@dataclass(kw_only=True)
class TrainConfig(Section):
    """[train]: the training loop."""

    _section: ClassVar[str] = "train"

    epochs: int = option(10, "passes over the sample pool", ge=1)
    max_steps: int = option(0, "stop after this many optimiser steps; 0 = no limit", ge=0)
    dtype: str = option("float32", "floating-point precision", choices=("float32", "float64"))
    precision: str = option("fp32", "compute precision of forward/backward: \"fp32\", \"bf16\" "
                                "(autocast; refused on CPUs without avx512_bf16/amx_bf16) or "
                                "\"auto\" (bf16 if every rank's CPU has them, else fp32; the "
                                "start-up line says which)",
                        choices=("fp32", "bf16", "auto"))
    compile: bool = option(False, "run the generator through torch.compile (needs a C++ compiler; "
                              "compiles for tens of seconds at start; off unless it pays)")
    compile_cache: str = option("", "TorchInductor cache directory kept across runs; empty = "
                                "RUN_DIR/compile_cache")
    fused_kernels: bool = option(False, "run each instance norm + GELU pair, and each decoder "
                                 "upsampling + skip concatenation, as one C kernel, and the 3x3 "
                                 "convolutions by Winograd's algorithm, built with the host's "
                                 "GCC at first use (2-D float32 channels_last steps; "
                                 "docs/performance.md, \"Fused kernels\")")
    init_seed: int = option(0, "seed of the network initialisation (identical on every rank)", ge=0)
    micro_batch: int = option(0, "samples per forward/backward (gradient accumulation); "
                             "0 = the whole local batch at once", ge=0)
    log_every: int = option(10, "log every this many steps", ge=1)
    eval_every_epochs: int = option(0, "evaluate every this many epochs; 0 = only at the end", ge=0)
    checkpoint_every: int = option(0, "checkpoint every this many steps; 0 = only by time "
                                      "(train.checkpoint_minutes) and at the end", ge=0)
    checkpoint_minutes: float = option(10.0, "also checkpoint when this many minutes have passed "
                                             "since the last checkpoint (rank 0's clock, agreed "
                                             "by all ranks); 0 = off", ge=0.0)
    time_limit_minutes: float = option(0.0, "stop after this many minutes of training in this "
                                            "process (rank 0's clock, agreed by all ranks): "
                                            "checkpoint and exit 99, as on SIGUSR1, to go on "
                                            "with --resume. For launchers that send no signal "
                                            "before their limit: set it a few minutes under "
                                            "it; 0 = none", ge=0.0)
    keep_checkpoints: int = option(2, "keep only the newest N checkpoints", ge=1)
    on_nonfinite: str = option("stop", "what to do on a NaN/inf loss or gradient",
                           choices=("stop", "rollback"))
    rollback_lr_factor: float = option(0.5, "multiply the learning rate by this at every "
                                            "rollback, in (0, 1)", gt=0.0, lt=1.0)
    rollback_min_lr_scale: float = option(1e-3, "stop (exit 3) instead of rolling back once the "
                                                "learning-rate scale would fall below this",
                                          gt=0.0, le=1.0)
    checksum_every: int = option(50, "all-reduce a parameter checksum every N steps to detect rank "
                                 "divergence; 0 = off", ge=0)
    levels: list[dict] = option([], "multigrid schedule: [[train.levels]] tables, each with grid, "
                                "steps or epochs, and optionally global_batch, micro_batch and "
                                "optim overrides; the run trains through them in one go (the "
                                "last one on problem.grid) and train.epochs is not used; "
                                "empty = one level, problem.grid for train.epochs")
    cycle: str = option("", "how train.levels are visited: \"\" as listed; \"half-v\" coarse "
                            "to fine; \"v\" finest, down to the coarsest, back up; \"f\" the "
                            "F-cycle (levels then listed coarse to fine)", choices=CYCLES)
    coarse_to_fine: int = option(0, "K >= 2: a multigrid schedule of K levels from one setting, "
                                    "written into train.levels when the config is resolved: "
                                    "each level halves the grid of the next finer one, the "
                                    "last is problem.grid; train.epochs' steps split 2:1 from "
                                    "each level to the next finer one; every finer level grows "
                                    "the network (prolong) at half the learning rate of the "
                                    "one below; 0 or 1 = off", ge=0)
    time_budget: str = option("", "wall time the training is planned to end within, e.g. "
                                  "\"15m\", \"1.5h\" or seconds (900): the run times its "
                                  "steps after the first few and sets its step count (and "
                                  "the learning-rate schedule over it) to fit, keeping a "
                                  "reserve for validations and checkpoints; train.epochs is "
                                  "then not used, train.max_steps caps the count; a single "
                                  "grid only; empty = off")

    def __post_init__(self):
        # a budget given as a number (TOML 900, --set train.time_budget=900) is seconds
        if isinstance(self.time_budget, (int, float)) and not isinstance(self.time_budget, bool):
            self.time_budget = f"{self.time_budget:g}"
        super().__post_init__()

    def budget_seconds(self) -> float:
        """``time_budget`` in seconds, 0 without one."""
        return budget_seconds(self.time_budget) if self.time_budget.strip() else 0.0

    def _validate(self):
        if self.time_budget.strip():
            try:
                self.budget_seconds()
            except ValueError as e:
                raise self._err("time_budget", str(e)) from None
            if self.levels or self.coarse_to_fine >= 2:
                what = "train.coarse_to_fine" if self.coarse_to_fine >= 2 else "train.levels"
                raise self._err("time_budget", f"plans a single grid's step count from its "
                                               f"measured step time, but {what} trains "
                                               f"several grids, whose steps take different "
                                               f"times: give the levels' lengths in steps or "
                                               f"epochs, or drop {what}")
        # Whether this CPU has bf16 instructions is the engine's question (engine.layout), asked
        # when the run is built: the configuration never probes the hardware.
        if self.precision in ("bf16", "auto") and self.dtype != "float32":
            raise self._err("precision", f"\"{self.precision}\" needs train.dtype = \"float32\" "
                                         f"(a float64 run computes in fp32: use \"fp32\")")


@dataclass(kw_only=True)
class ParallelConfig(Section):
    """[parallel]: threads, gradient communication, the domain split and the useful job size."""

    _section: ClassVar[str] = "parallel"

    threads_per_rank: int = option(0, "torch intra-op threads per rank; 0 = auto (cores / ranks "
                                  "on the node)", ge=0)
    overlap: bool = option(False, "overlap the gradient allreduce with backward (bucketed, "
                              "non-blocking)")
    bucket_mb: float = option(4.0, "gradient bucket size in MB when parallel.overlap is on", gt=0.0)
    allreduce_stats: str = option("auto", "write the gradient allreduce's seconds per rank into "
                                  "every step record of metrics.jsonl: waiting for the other "
                                  "ranks (allreduce_wait_s), moving the bytes (allreduce_move_s), "
                                  "what the step waits for after backward (allreduce_exposed_s); "
                                  "they travel in the step's loss allreduce, 5 numbers per rank, "
                                  "no extra collective; \"auto\" = on from 2 to 16 ranks (the "
                                  "record holds one number per rank)",
                                  choices=("auto", "on", "off"))
    reuse_memory: str = option("auto", "keep freed memory in the process for the next step "
                               "instead of returning it to the OS and faulting it in again "
                               "(glibc malloc: no mmap for large blocks, no trimming): faster "
                               "steps on large grids for more peak memory; "
                               "\"auto\" = on without a domain split, off with one (a split "
                               "exists to save memory)", choices=("auto", "on", "off"))
    domain: list[int] = option([], "domain parallelism: split every sample's grid into blocks, "
                               "one block count per grid axis (e.g. [1, 2]: two blocks along the "
                               "columns), one block per rank; the P ranks form P / prod(domain) "
                               "data-parallel groups that each hold whole samples; [] = no split",
                               item_ge=1, max_len=3)
    max_useful_ranks: int = option(0, "the rank count past which this config's time to its "
                                      "accuracy stops falling (a recipe's measured limit): "
                                      "'deepfusion check --ranks P', 'train' and 'jobs render' "
                                      "warn when P is larger, they do not refuse; 0 = not "
                                      "stated (check then gives the batches' data-parallel "
                                      "limit)", ge=0)

    def allreduce_stats_on(self, ranks: int) -> bool:
        """Whether a run of ``ranks`` ranks accounts its gradient allreduce per rank."""
        if ranks < 2 or self.allreduce_stats == "off":
            return False
        return self.allreduce_stats == "on" or ranks <= 16

    def reuses_memory(self) -> bool:
        """Whether freed memory is kept for reuse (``reuse_memory``, "auto" resolved)."""
        return self.reuse_memory == "on" or (self.reuse_memory == "auto" and self.blocks() <= 1)

    def blocks(self) -> int:
        """Ranks per domain group (1 without a split)."""
        n = 1
        for d in self.domain:
            n *= d
        return n


@dataclass(kw_only=True)
class RunConfig(Section):
    """[run]: where outputs go and how progress is shown."""

    _section: ClassVar[str] = "run"

    dir: str = option("runs/default", "run directory (checkpoints/, logs, metrics)")
    progress: str = option("auto", "progress display: a bar on a terminal, log lines otherwise",
                       choices=("auto", "bar", "log"))
    plots: bool = option(True, "draw loss.png and eval.png at the end of the run (rank 0, "
                         "matplotlib: about a second); false writes metrics.jsonl and "
                         "eval.json without figures, e.g. for sweeps of many short runs")

    def _validate(self):
        if not self.dir.strip():
            raise self._err("dir", "must be a non-empty directory path, e.g. \"runs/my-run\"")


SECTIONS: dict[str, type[Section]] = {
    "problem": ProblemConfig,
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "parallel": ParallelConfig,
    "run": RunConfig,
}


@dataclass(kw_only=True)
class Config:
    """The whole run configuration, one attribute per TOML section."""

    problem: ProblemConfig = field(default_factory=ProblemConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self):
        for name, cls in SECTIONS.items():
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, _build_section(name, value))
            elif not isinstance(value, cls):
                raise ConfigError(f"{name} must be a {cls.__name__} (or a [{name}] table), "
                                  f"{describe_value(value)}", key=name)
        expand_coarse_to_fine(self)  # train.levels from train.coarse_to_fine, before their checks
        check_levels(self)
        if self.parallel.domain and len(self.parallel.domain) != len(self.problem.grid):
            raise ConfigError(
                f"parallel.domain = {self.parallel.domain} must give one block count per axis of "
                f"problem.grid = {self.problem.grid}, e.g. {[1] * (len(self.problem.grid) - 1) + [2]}",
                key="parallel.domain")
        if self.problem.correction and self.parallel.domain:
            raise ConfigError(
                f"problem.correction = {self.problem.correction} corrects each answer on the "
                f"whole grid of one rank, and parallel.domain = {self.parallel.domain} splits it: "
                f"drop one (problem.correction = 0, or parallel.domain = [])",
                key="problem.correction")
        if (not self.train.levels and not self.train.time_budget.strip()
                and self.optim.switch_to_lbfgs_epoch >= self.train.epochs):
            raise ConfigError(
                f"optim.switch_to_lbfgs_epoch must be < train.epochs ({self.train.epochs}) to "
                f"take effect, got {self.optim.switch_to_lbfgs_epoch}; use -1 for never",
                key="optim.switch_to_lbfgs_epoch")


# ---------------------------------------------------------------------------------------------
# building from raw dicts
# ---------------------------------------------------------------------------------------------

def _unknown_key(dotted: str) -> ConfigError:
    """'unknown key ...; did you mean ...?' with the closest valid key."""
    return unknown_key(dotted, SECTIONS)


def _build_section(name: str, table) -> Section:
    cls = SECTIONS[name]
    if not isinstance(table, dict):
        raise ConfigError(f"{name} must be a table (a [{name}] section), {describe_value(table)}", key=name)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in table:
        if key not in names:
            raise _unknown_key(f"{name}.{key}")
    return cls(**table)


def config_from_dict(raw: dict) -> Config:
    """Validate a raw nested dict (as read from TOML) and build a :class:`Config`."""
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a table of sections, {describe_value(raw)}")
    sections = {}
    for name, table in raw.items():
        if name not in SECTIONS:
            raise _unknown_key(str(name))
        sections[name] = _build_section(name, table)
    return Config(**sections)


def config_to_dict(cfg: Config) -> dict:
    """A plain nested dict (JSON- and TOML-able) of the config."""
    return dataclasses.asdict(cfg)
