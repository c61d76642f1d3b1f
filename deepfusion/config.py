"""The run configuration: a TOML file parsed into typed, validated dataclasses.

One ``@dataclass(kw_only=True)`` per TOML section (``[problem]``, ``[model]``, ``[data]``,
``[optim]``, ``[train]``, ``[parallel]``, ``[run]``), gathered in :class:`Config`. Every field
carries its help text in ``field(metadata={"help": ...})``; :func:`describe` prints them all.
Every check lives in ``__post_init__`` so a config built in Python is validated exactly like one
read from a file, and every error is a :class:`ConfigError` whose message names the dotted key
(``optim.lr``) and says how to fix it.

    cfg = load_config("configs/burgers.toml", ["optim.lr=3e-4", "train.epochs=5"])
    text = dump_toml(cfg)            # the resolved config, loadable again

The generic machinery (field helper, type checks, "did you mean" hints, TOML writing, help
text) is in :mod:`deepfusion.config_schema`; this module holds the sections and the reading.

Pure Python: this module imports no PDE, no model and no MPI.
"""
from __future__ import annotations

import copy
import dataclasses
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .config_schema import (ConfigError, _f, _got, _Section, describe_sections, dump_tables,
                            unknown_key)


def _import_toml(version_info=sys.version_info):
    """The TOML reader: ``tomllib`` on Python 3.11+, the ``tomli`` backport on 3.10."""
    if tuple(version_info[:2]) >= (3, 11):
        import tomllib

        return tomllib
    try:
        import tomli
    except ImportError as exc:  # pragma: no cover - depends on the interpreter
        raise ImportError(
            "reading TOML configs on Python < 3.11 needs the 'tomli' package: pip install tomli"
        ) from exc
    return tomli


tomllib = _import_toml()


# ---------------------------------------------------------------------------------------------
# the sections
# ---------------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class ProblemConfig(_Section):
    """[problem]: which parametric PDE family to solve, on which node grid."""

    _section: ClassVar[str] = "problem"

    name: str = _f("burgers", "registered PDE family (e.g. burgers, poisson, reaction_diffusion)")
    grid: list[int] = _f([64, 64], "node grid [H, W], boundary nodes included; >= 4 per axis",
                         item_ge=4, min_len=1, max_len=3)
    options: dict[str, Any] = _f({}, "problem-specific keyword arguments passed to the problem "
                                     "constructor (validated there), e.g. {c_range = [3, 6]}")

    def _validate(self):
        if not self.name.strip():
            raise self._err("name", "must be a non-empty problem name, e.g. \"burgers\"")
        if "grid" in self.options:
            raise ConfigError("problem.options.grid is not allowed: set problem.grid instead",
                              key="problem.options.grid")


@dataclass(kw_only=True)
class ModelConfig(_Section):
    """[model]: the generator network."""

    _section: ClassVar[str] = "model"

    name: str = _f("unet", "registered generator architecture")
    options: dict[str, Any] = _f({}, "generator keyword arguments, e.g. {depth = 4, base_width = 32}")
    channels_last: bool = _f(True, "use the channels_last (NHWC) memory format (faster oneDNN convs)")
    init_from: str = _f("", "checkpoint whose generator weights start this run (warm start, e.g. "
                            "coarse-to-fine from a coarser grid); its step and optimiser state are "
                            "not taken; same generator architecture required; empty = random init")

    def _validate(self):
        if not self.name.strip():
            raise self._err("name", "must be a non-empty model name, e.g. \"unet\"")


@dataclass(kw_only=True)
class DataConfig(_Section):
    """[data]: the parameter-sample pool (DiffNet is data-free: samples are PDE parameters)."""

    _section: ClassVar[str] = "data"

    n_samples: int = _f(256, "size N_s of the training pool of parameter samples", ge=1)
    seed: int = _f(0, "seed of the training pool draw", ge=0)
    global_batch: int = _f(32, "samples per optimiser step over ALL ranks (split across ranks)",
                           ge=1)
    eval_samples: int = _f(16, "held-out parameter draws used for evaluation", ge=0)
    eval_seed: int = _f(12345, "seed of the held-out draw; must differ from data.seed", ge=0)

    def _validate(self):
        if self.n_samples < self.global_batch:
            raise self._err("n_samples", f"must be >= data.global_batch ({self.global_batch}), "
                                         f"got {self.n_samples}; enlarge the pool or shrink "
                                         f"the batch")
        if self.eval_seed == self.seed:
            raise self._err("eval_seed", f"must differ from data.seed (both are {self.seed}), "
                                         f"otherwise the held-out set repeats training samples")


@dataclass(kw_only=True)
class OptimConfig(_Section):
    """[optim]: optimiser and learning-rate schedule."""

    _section: ClassVar[str] = "optim"

    name: str = _f("adam", "optimiser", choices=("adam", "sgd", "lbfgs"))
    lr: float = _f(1e-3, "peak learning rate", gt=0.0)
    weight_decay: float = _f(0.0, "L2 weight decay", ge=0.0)
    betas: list[float] = _f([0.9, 0.999], "Adam (beta1, beta2), each in [0, 1)",
                            min_len=2, max_len=2, item_ge=0.0)
    momentum: float = _f(0.9, "SGD momentum, in [0, 1)", ge=0.0, lt=1.0)
    schedule: str = _f("cosine", "learning-rate schedule after warm-up",
                       choices=("constant", "cosine", "step", "exponential"))
    warmup_steps: int = _f(0, "linear warm-up steps from 0 to optim.lr", ge=0)
    min_lr: float = _f(0.0, "floor of the learning rate (cosine end value)", ge=0.0)
    step_size: int = _f(1000, "steps between decays (schedule = \"step\")", ge=1)
    gamma: float = _f(0.5, "decay factor (step: per step_size; exponential: per step), in (0, 1]",
                      gt=0.0, le=1.0)
    grad_clip: float = _f(0.0, "clip the global gradient norm to this value; 0 = off", ge=0.0)
    lbfgs_history: int = _f(20, "L-BFGS history size", ge=1)
    lbfgs_max_iter: int = _f(20, "L-BFGS iterations per optimiser step", ge=1)
    lbfgs_tolerance_grad: float = _f(1e-9, "L-BFGS first-order optimality tolerance", ge=0.0)
    lbfgs_tolerance_change: float = _f(1e-12, "L-BFGS function/parameter change tolerance",
                                       ge=0.0)
    lbfgs_line_search: str = _f("strong_wolfe", "L-BFGS line search",
                                choices=("strong_wolfe", "none"))
    switch_to_lbfgs_epoch: int = _f(-1, "switch from adam/sgd to L-BFGS at this epoch; -1 = never",
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
                            "only applies when optim.name is 'adam' or 'sgd' (it is already "
                            "'lbfgs'); set it to -1")


@dataclass(kw_only=True)
class TrainConfig(_Section):
    """[train]: the training loop."""

    _section: ClassVar[str] = "train"

    epochs: int = _f(10, "passes over the sample pool", ge=1)
    max_steps: int = _f(0, "stop after this many optimiser steps; 0 = no limit", ge=0)
    dtype: str = _f("float32", "floating-point precision", choices=("float32", "float64"))
    precision: str = _f("fp32", "compute precision of forward/backward: \"fp32\" or \"bf16\" "
                                "(autocast; refused on CPUs without avx512_bf16/amx_bf16)",
                        choices=("fp32", "bf16"))
    compile: bool = _f(False, "run the generator through torch.compile (needs a C++ compiler; "
                              "compiles for tens of seconds at start; off unless it pays)")
    compile_cache: str = _f("", "TorchInductor cache directory kept across runs; empty = "
                                "RUN_DIR/compile_cache")
    init_seed: int = _f(0, "seed of the network initialisation (identical on every rank)", ge=0)
    micro_batch: int = _f(0, "samples per forward/backward (gradient accumulation); "
                             "0 = the whole local batch at once", ge=0)
    log_every: int = _f(10, "log every this many steps", ge=1)
    eval_every_epochs: int = _f(0, "evaluate every this many epochs; 0 = only at the end", ge=0)
    checkpoint_every: int = _f(0, "checkpoint every this many steps; 0 = only at the end", ge=0)
    keep_checkpoints: int = _f(2, "keep only the newest N checkpoints", ge=1)
    on_nonfinite: str = _f("stop", "what to do on a NaN/inf loss or gradient",
                           choices=("stop", "rollback"))
    rollback_lr_factor: float = _f(0.5, "multiply the learning rate by this after a rollback, "
                                        "in (0, 1]", gt=0.0, le=1.0)
    checksum_every: int = _f(50, "all-reduce a parameter checksum every N steps to detect rank "
                                 "divergence; 0 = off", ge=0)
    fail_at_step: int = _f(-1, "test hook: raise on rank train.fail_rank at this step; -1 = off",
                           ge=-1)
    fail_rank: int = _f(0, "test hook: the rank that fails at train.fail_at_step", ge=0)

    def _validate(self):
        if self.precision == "bf16":
            from .layout import check_precision  # reads /proc/cpuinfo; no torch, no MPI

            try:
                check_precision(self.precision)
            except ValueError as exc:
                raise ConfigError(str(exc), key="train.precision") from None
            if self.dtype != "float32":
                raise self._err("precision", "\"bf16\" needs train.dtype = \"float32\"")


@dataclass(kw_only=True)
class ParallelConfig(_Section):
    """[parallel]: threads and gradient communication."""

    _section: ClassVar[str] = "parallel"

    threads_per_rank: int = _f(0, "torch intra-op threads per rank; 0 = auto (cores / ranks "
                                  "on the node)", ge=0)
    overlap: bool = _f(False, "overlap the gradient allreduce with backward (bucketed, "
                              "non-blocking)")
    bucket_mb: float = _f(4.0, "gradient bucket size in MB when parallel.overlap is on", gt=0.0)


@dataclass(kw_only=True)
class RunConfig(_Section):
    """[run]: where outputs go and how progress is shown."""

    _section: ClassVar[str] = "run"

    dir: str = _f("runs/default", "run directory (checkpoints/, logs, metrics)")
    progress: str = _f("auto", "progress display: a bar on a terminal, log lines otherwise",
                       choices=("auto", "bar", "log"))

    def _validate(self):
        if not self.dir.strip():
            raise self._err("dir", "must be a non-empty directory path, e.g. \"runs/burgers\"")


_SECTIONS: dict[str, type[_Section]] = {
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
        for name, cls in _SECTIONS.items():
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, _build_section(name, value))
            elif not isinstance(value, cls):
                raise ConfigError(f"{name} must be a {cls.__name__} (or a [{name}] table), "
                                  f"{_got(value)}", key=name)
        if self.optim.switch_to_lbfgs_epoch >= self.train.epochs:
            raise ConfigError(
                f"optim.switch_to_lbfgs_epoch must be < train.epochs ({self.train.epochs}) to "
                f"take effect, got {self.optim.switch_to_lbfgs_epoch}; use -1 for never",
                key="optim.switch_to_lbfgs_epoch")


# ---------------------------------------------------------------------------------------------
# building from raw dicts
# ---------------------------------------------------------------------------------------------

def _unknown_key(dotted: str) -> ConfigError:
    """'unknown key ...; did you mean ...?' with the closest valid key."""
    return unknown_key(dotted, _SECTIONS)


def _build_section(name: str, table) -> _Section:
    cls = _SECTIONS[name]
    if not isinstance(table, dict):
        raise ConfigError(f"{name} must be a table (a [{name}] section), {_got(table)}", key=name)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in table:
        if key not in names:
            raise _unknown_key(f"{name}.{key}")
    return cls(**table)


def config_from_dict(raw: dict) -> Config:
    """Validate a raw nested dict (as read from TOML) and build a :class:`Config`."""
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a table of sections, {_got(raw)}")
    sections = {}
    for name, table in raw.items():
        if name not in _SECTIONS:
            raise _unknown_key(str(name))
        sections[name] = _build_section(name, table)
    return Config(**sections)


def config_to_dict(cfg: Config) -> dict:
    """A plain nested dict (JSON- and TOML-able) of the config."""
    return dataclasses.asdict(cfg)


# ---------------------------------------------------------------------------------------------
# overrides and files
# ---------------------------------------------------------------------------------------------

def _parse_value(text: str):
    """A TOML value (number, bool, string, array, inline table), else the bare string."""
    text = text.strip()
    try:
        parsed = tomllib.loads(f"v = {text}")
    except tomllib.TOMLDecodeError:
        return text
    if set(parsed) != {"v"}:  # e.g. a newline smuggling in a second key: keep it literal
        return text
    return parsed["v"]


def _split_override(item: str) -> tuple[list[str], str]:
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(f"malformed override {item!r}: use the form key=value, "
                          f"e.g. optim.lr=3e-4")
    key, _, text = item.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not key or any(not p.strip() for p in parts):
        raise ConfigError(f"malformed override {item!r}: the key must be a dotted path like "
                          f"optim.lr (form key=value)")
    return [p.strip() for p in parts], text


def apply_overrides(raw: dict, overrides: typing.Iterable[str]) -> dict:
    """Return a copy of ``raw`` with each ``"a.b=value"`` applied (value parsed as TOML)."""
    out = copy.deepcopy(raw)
    if isinstance(overrides, str):
        overrides = [overrides]
    for item in overrides:
        parts, text = _split_override(item)
        node = out
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                raise ConfigError(f"cannot set {'.'.join(parts)!r}: {where!r} is a value, "
                                  f"not a table", key=where)
            node = child
        node[parts[-1]] = _parse_value(text)
    return out


def _read_toml(path: str) -> dict:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"invalid TOML in {path}: {exc}") from None


def load_config(path: str | None = None, overrides: typing.Iterable[str] = ()) -> Config:
    """Read ``path`` (``None``: all defaults), apply ``overrides`` and validate."""
    raw = {} if path is None else _read_toml(str(path))
    overrides = [overrides] if isinstance(overrides, str) else list(overrides)
    raw = apply_overrides(raw, overrides)
    try:
        return config_from_dict(raw)
    except ConfigError as exc:
        overridden = {".".join(_split_override(o)[0]) for o in overrides}
        if path is not None and exc.key not in overridden:
            raise ConfigError(f"{exc} (in {path})", key=exc.key) from None
        raise


# ---------------------------------------------------------------------------------------------
# writing and describing (the generic parts are in config_schema)
# ---------------------------------------------------------------------------------------------

def dump_toml(cfg: Config) -> str:
    """The resolved config as TOML text (round-trips through :func:`load_config`)."""
    header = "# DeepFusion resolved configuration (written by deepfusion.config.dump_toml)"
    return dump_tables(header, config_to_dict(cfg))


def describe() -> str:
    """Every key with its type, default, allowed values and help text."""
    return describe_sections(_SECTIONS)


__all__ = [
    "Config", "ConfigError", "DataConfig", "ModelConfig", "OptimConfig", "ParallelConfig",
    "ProblemConfig", "RunConfig", "TrainConfig", "apply_overrides", "config_from_dict",
    "config_to_dict", "describe", "dump_toml", "load_config",
]
