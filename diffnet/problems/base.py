"""The contract every PDE family implements (one module per PDE, registered by name).

A problem is a *parametric family* of PDEs on a fixed rectangular node grid. The engine only
ever calls the methods below, so adding a PDE means adding one module under
``diffnet/problems/`` and one line in the registry (``diffnet/problems/__init__.py``).

Grid convention: a field is a tensor (B, 1, H, W). Rows run along ``axes[0]`` and columns along
``axes[1]`` (Burgers: ("t", "x"), so row 0 is t=0; Poisson: ("y", "x")). Nodes include the
boundary: axis a has ``n`` nodes on ``[lo, hi]`` with spacing ``(hi - lo) / (n - 1)``.

Losses are returned *per sample* (shape (B,)) and already weighted, so that the total loss of a
sample is ``sum(terms.values())``. The engine sums them over the local batch, all-reduces the
sums and divides by the global batch size: the mean over the global batch, whatever the number
of ranks.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Axis:
    """One grid axis: its name and the closed interval its nodes cover."""

    name: str
    lo: float
    hi: float


def check_range(name: str, value, *, allow_equal: bool = False) -> tuple[float, float]:
    """Validate a (lo, hi) parameter range; raise ValueError naming the argument otherwise."""
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a pair (lo, hi) of numbers, got {value!r}") from None
    if not (np.isfinite(lo) and np.isfinite(hi)):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if hi < lo or (hi == lo and not allow_equal):
        raise ValueError(f"{name} must satisfy lo < hi (an empty or reversed range), got {value!r}")
    return lo, hi


def check_grid(grid) -> tuple[int, int]:
    """Validate a grid (H, W) of node counts; at least 4 nodes per axis (the one-sided stencils)."""
    try:
        h, w = (int(v) for v in grid)
    except (TypeError, ValueError):
        raise ValueError(f"grid must be a pair (H, W) of integers, got {grid!r}") from None
    if h < 4 or w < 4:
        raise ValueError(f"grid must have at least 4 nodes per axis, got {grid!r}")
    return h, w


def check_choice(name: str, value, allowed) -> str:
    """Validate that ``value`` is one of ``allowed``; raise ValueError naming the argument."""
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")
    return value


def check_number(name: str, value, *, lo: float = -np.inf, hi: float = np.inf,
                 lo_open: bool = False, what: str = "") -> float:
    """Validate a finite real number in [lo, hi] (or (lo, hi] with lo_open); ValueError otherwise."""
    desc = what or f"a finite number {'>' if lo_open else '>='} {lo}" + (f" and <= {hi}" if np.isfinite(hi) else "")
    if isinstance(value, bool):
        raise ValueError(f"{name} must be {desc}, got {value!r}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {desc}, got {value!r}") from None
    if not np.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
        raise ValueError(f"{name} must be {desc}, got {value!r}")
    return v


def check_bool(name: str, value) -> bool:
    """Validate a real bool (not a truthy number or string)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


class Problem(abc.ABC):
    """A parametric PDE family. Subclasses state their equation in the class docstring.

    Class attributes every subclass sets:
        name: registry name, e.g. "burgers".
        param_names: names of the k entries of a parameter vector, e.g. ("c",).
        input_channels: names of the C channels ``build_input`` returns, e.g. ("u0",) or ("nu",).
        loss_term_names: the keys of ``loss_terms``, in the order they are logged.
    """

    name: str = ""
    param_names: tuple[str, ...] = ()
    input_channels: tuple[str, ...] = ()
    loss_term_names: tuple[str, ...] = ("pde", "bc")

    def __init__(self, *, grid=(64, 64)):
        self.grid = check_grid(grid)

    # -- geometry ---------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def axes(self) -> tuple[Axis, Axis]:
        """(row axis, column axis) of the output field."""

    @property
    def spacing(self) -> tuple[float, float]:
        """Node spacing (h_row, h_col)."""
        return tuple((a.hi - a.lo) / (n - 1) for a, n in zip(self.axes, self.grid))

    def coords(self) -> dict[str, np.ndarray]:
        """One float64 1-D coordinate array per axis name."""
        return {a.name: np.linspace(a.lo, a.hi, n) for a, n in zip(self.axes, self.grid)}

    # -- parameters -------------------------------------------------------------------------
    @abc.abstractmethod
    def param_bounds(self) -> np.ndarray:
        """(k, 2) float64 array of the [lo, hi] range each parameter is sampled from."""

    def sample_params(self, seed: int, indices) -> np.ndarray:
        """(n, k) float64 parameter vectors; row j depends only on (seed, indices[j]).

        Each index gets its own generator seeded by (seed, index), so the pool is the same
        whichever subset of indices a rank asks for.
        """
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and idx.min() < 0:
            raise ValueError(f"sample indices must be >= 0, got min {idx.min()}")
        bounds = self.param_bounds()
        out = np.empty((idx.size, len(self.param_names)), dtype=np.float64)
        for j, i in enumerate(idx):
            rng = np.random.default_rng([int(seed), int(i)])
            out[j] = bounds[:, 0] + (bounds[:, 1] - bounds[:, 0]) * rng.random(len(self.param_names))
        return out

    def check_params(self, params: np.ndarray) -> np.ndarray:
        """Validate shape (n, k); return a list of human-readable out-of-range warnings' data."""
        params = np.asarray(params, dtype=np.float64)
        if params.ndim != 2 or params.shape[1] != len(self.param_names):
            raise ValueError(
                f"{self.name}: parameters must have shape (n, {len(self.param_names)}) "
                f"for {self.param_names}, got {params.shape}")
        return params

    # -- fields and losses ------------------------------------------------------------------
    @abc.abstractmethod
    def build_input(self, params: np.ndarray, dtype=torch.float32) -> torch.Tensor:
        """(n, C, H, W) network input for parameter vectors ``params`` (n, k)."""

    @abc.abstractmethod
    def impose(self, u: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """Apply the hard-imposed boundary/initial values (if this problem instance uses them)
        to the generator's raw output (B, 1, H, W); identity otherwise."""

    @abc.abstractmethod
    def loss_terms(self, u: torch.Tensor, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-sample, already weighted loss terms, each of shape (B,).

        Keys are ``loss_term_names``, fixed per problem (by default "pde" and "bc"; a
        hard-imposed or natural condition gives a zero "bc"). The sample's loss is the sum.
        """

    @abc.abstractmethod
    def reference_solution(self, params: np.ndarray) -> np.ndarray:
        """(H, W) float64 solution of one parameter vector (k,) by the classical solver."""

    def set_progress(self, fraction: float) -> None:
        """Training progress step / total_steps in [0, 1], set by the trainer before each step.

        A loss that follows a schedule (a homotopy annealed over training) reads it; the default
        loss does not depend on it. Being a function of the step, it is the same on every rank
        and after a resume.
        """

    def config(self) -> dict:
        """Constructor keyword arguments that rebuild this instance (stored in checkpoints)."""
        return {"grid": list(self.grid)}
