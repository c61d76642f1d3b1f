"""The contract every PDE family implements: a subclass of :class:`Problem`.

A problem is a *parametric family* of PDEs on a fixed rectangular node grid. The engine only
ever calls the methods below, so a PDE lives in any importable module: ``problem.name =
"package.module:ClassName"`` or an entry point of group ``diffnet.problems`` finds it
(``diffnet.problems.registry``), with no edit of this package; ``deepfusion check-problem``
checks a class against this contract (docs/your-own-pde.md).

Grid convention: a field is a tensor (B, 1, H, W). Rows run along ``axes[0]`` and columns along
``axes[1]`` (Burgers: ("t", "x"), so row 0 is t=0; Poisson: ("y", "x")). Nodes include the
boundary: axis a has ``n`` nodes on ``[lo, hi]`` with spacing ``(hi - lo) / (n - 1)``.

Losses are returned *per sample* (shape (B,)) and already weighted, so that the total loss of a
sample is ``sum(terms.values())``. The engine sums them over the local batch, all-reduces the
sums and divides by the global batch size: the mean over the global batch, whatever the number
of ranks.

Domain parallelism (``diffnet.domain``): a problem holds ``self.block``, the block of the node
grid it computes on (``Block(grid)``, the whole grid, unless ``on_block`` set another). On a
split block, ``impose(u, inputs)`` and ``loss_terms(u, inputs)`` receive the BLOCK'S PART of u
and of the inputs (built for the global grid and cut with ``block.local``), and every returned
per-sample term is this block's PART: the sum over the blocks of each term equals the undivided
term, value and gradient (up to rounding; the collectives' backward carries the gradient
across blocks, so every block must backpropagate its whole loss, all terms together, as the
engine does). A loss written with the split-exact helpers has that property with no block code
(:mod:`.blocks`; each is a method here): derivatives by ``FiniteDifference(u, self.block)``,
means over nodes by ``self.mean(t, interior)``, boundary terms by ``self.wall_mean(t, axis,
side)``, quantities on edges by ``self.edges(t)``, global masks and weights cut by
``self.part``, non-linear reductions by ``self.total`` and ``self.share``; a plain sum over
nodes needs nothing. A term written otherwise is declared in ``unsplit_terms`` (``on_block``
then refuses a split naming it), and options that cannot split are refused by ``check_block``
with a ValueError saying why.

Inputs given as fields (``inputs_from_fields``) and the reference solution of given fields
(``solve_from_inputs``) are part of the contract too, so the application can run a network or a
reference solver on a user's fields without knowing which PDE (or which channel) it handles.
"""
from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

# The checks live in diffnet.validation; re-exported here for code that imported them from base.
from ..domain import Block
from ..validation import (check_array, check_bool, check_choice, check_grid,  # noqa: F401
                          check_number, check_range, grid_axes)
from .answer_check import flags
from .blocks import cut, edges, node_mean, share, total, wall_mean


@dataclass(frozen=True)
class Axis:
    """One grid axis: its name and the closed interval its nodes cover."""

    name: str
    lo: float
    hi: float


class Problem(abc.ABC):
    """A parametric PDE family. Subclasses state their equation in the class docstring.

    Class attributes every subclass sets:
        name: registry name, e.g. "burgers".
        param_names: names of the k entries of a parameter vector, e.g. ("c",).
        input_channels: names of the C channels ``build_input`` returns, e.g. ("u0",) or ("nu",).
        loss_term_names: the keys of ``loss_terms``, in the order they are logged.
        reference_methods: the ``method`` values ``reference_solution`` and
            ``solve_from_inputs`` accept; "auto" (the solver's own choice) always comes first.
            Empty: the family has no reference solver (it trains and infers; the application
            refuses solve and compare, and evaluation reports the loss instead of an error).
        solves_from_inputs: whether ``solve_from_inputs`` is available (False: the reference
            solver needs parameter vectors).
        fields_hint: optional text for the message of missing channels in
            ``inputs_from_fields``, e.g. which channels are derived from which.
        refines: whether ``refine`` is available (the reference solver is iterative and
            takes an initial guess: an approximate answer is refined to a tolerance).
        dims: the number of grid axes (2: (H, W); 3: (D, H, W)).
        output_channels: the fields the generator outputs (default 1); ``impose`` maps them
            to the one solution field (B, 1, *grid).
        unsplit_terms: the loss terms NOT written with the split-exact helpers (default none):
            a split block is refused naming them (an instance may set it by its options).
        residual_threshold: the ``answer_residual`` above which an answer is flagged as not to
            be trusted; None (default): the family has no answer residual.
        detached_terms: the loss terms that hold part of their value fixed on purpose (a
            target with no gradient through it): their autograd gradient is not the
            derivative of their value, so the checker's gradient check leaves them out and
            says so (default none; an instance may set it by its options).
    """

    name: str = ""
    param_names: tuple[str, ...] = ()
    input_channels: tuple[str, ...] = ()
    loss_term_names: tuple[str, ...] = ("pde", "bc")
    reference_methods: tuple[str, ...] = ("auto",)
    solves_from_inputs: bool = False
    refines: bool = False
    fields_hint: str = ""
    dims: int = 2
    output_channels: int = 1
    unsplit_terms: tuple[str, ...] = ()
    residual_threshold: float | None = None
    detached_terms: tuple[str, ...] = ()

    def __init__(self, *, grid=(64, 64)):
        self.grid = check_grid(grid)
        self.block = Block(self.grid)

    # -- domain parallelism ------------------------------------------------------------------
    def on_block(self, block: Block) -> "Problem":
        """Compute on ``block`` of the grid from now on (see the module docstring); returns self.

        ValueError if the block is not one of this grid or this problem cannot compute on it
        (``check_split_block``: its ``unsplit_terms``, then ``check_block``).
        """
        if tuple(block.grid) != tuple(self.grid):
            raise ValueError(f"block {block!r} is a block of grid {list(block.grid)}, but problem "
                             f"{self.name!r} is on grid {list(self.grid)}")
        if not block.whole:
            self.check_split_block(block)
        self.block = block
        return self

    def check_split_block(self, block: Block) -> None:
        """What ``on_block`` checks of a split ``block``, without moving to it: ValueError
        naming the ``unsplit_terms`` if any, then ``check_block``'s."""
        if self.unsplit_terms:
            raise ValueError(
                f"problem {self.name!r} computes its loss term(s) {list(self.unsplit_terms)} on "
                f"the whole grid only (they are not written with the split-exact helpers of "
                f"diffnet.problems.blocks): run without a domain split (parallel.domain = []), "
                f"or write them with the helpers (docs/your-own-pde.md)")
        self.check_block(block)

    def check_block(self, block: Block) -> None:
        """ValueError if this problem cannot compute its losses on the split ``block``
        (called by ``on_block``; the default accepts every block)."""

    def part(self, field: torch.Tensor) -> torch.Tensor:
        """This block's part of a global field (..., *grid), grid axes of size 1 broadcast
        (masks, weights); the field itself when undivided. A view, no copy."""
        return cut(self.block, field)

    # -- split-exact helpers (diffnet.problems.blocks): a loss written with them splits ------
    def mean(self, t: torch.Tensor, interior=0) -> torch.Tensor:
        """(B,) mean of a nodal field t (B, ..., *grid) over the nodes at least ``interior``
        nodes (an int, or one per axis) from the boundary; this block's part on a split."""
        return node_mean(self.block, t, interior)

    def wall_mean(self, t: torch.Tensor, axis: int, side: str) -> torch.Tensor:
        """(B,) mean of a nodal field t over the boundary nodes of grid ``axis`` on ``side``
        ("lo" or "hi"); this block's part on a split (zero on a block away from the wall)."""
        return wall_mean(self.block, t, axis, side)

    def edges(self, t: torch.Tensor, axes=None) -> list:
        """[(first, second) end nodes of the edges along each of ``axes`` (default all)] that
        this block owns, t (B, C, *grid): each edge of the grid once over the blocks."""
        return edges(self.block, t, axes)

    def total(self, part: torch.Tensor) -> torch.Tensor:
        """The sum over the blocks of per-sample partial sums ``part`` (B,), on every block:
        the inside of a non-linear reduction; return a function of it through ``share``."""
        return total(self.block, part)

    def share(self, value: torch.Tensor) -> torch.Tensor:
        """This block's share of a value every block holds (a function of ``total``)."""
        return share(self.block, value)

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

    def build_block_input(self, params: np.ndarray, block: Block,
                          dtype=torch.float32) -> torch.Tensor:
        """(n, C, *block.shape) network input of ``params`` on the nodes of ``block`` (a block
        of this grid) only: bit for bit ``cut(block, build_input(params, dtype))``, what a rank
        of a domain split needs. This default builds the whole grid and cuts it (right for
        any problem, no saving); a problem whose inputs are pointwise functions of the node
        coordinates overrides it to evaluate the block's nodes alone."""
        x = cut(block, self.build_input(params, dtype=dtype))
        return x if block.whole else x.clone(memory_format=torch.contiguous_format)

    def inputs_from_fields(self, fields: Mapping) -> np.ndarray:
        """(N, C, H, W) float64 network input from given fields keyed by channel name.

        ``fields`` maps channel names to (N, H, W) arrays on this problem's grid. This default
        takes every channel of ``input_channels``, no more and no fewer, in that order; a
        problem that can derive a channel from another (a logarithm, a coordinate) overrides
        it. ValueError naming the channels given and the ones needed, or the bad field.
        """
        return self.stack_fields(self.check_fields(fields))

    def check_fields(self, fields: Mapping) -> dict[str, np.ndarray]:
        """The fields as finite float64 (N, *grid) arrays on this grid, all with the same N."""
        form = f"(N, {grid_axes(len(self.grid))})"
        if not isinstance(fields, Mapping) or not fields:
            raise ValueError(f"fields must be a non-empty dict of channel name -> {form} "
                             f"array; problem {self.name!r} needs {list(self.input_channels)}")
        out = {str(k): check_array(f"field {k!r}", v, ndim=1 + len(self.grid), form=form)
               for k, v in fields.items()}
        for k, a in out.items():
            if a.shape[1:] != self.grid:
                raise ValueError(f"field {k!r} is on a {'x'.join(map(str, a.shape[1:]))} grid, "
                                 f"but problem {self.name!r} is on "
                                 f"{'x'.join(map(str, self.grid))}: build the problem on the "
                                 f"fields' grid")
        counts = {k: a.shape[0] for k, a in out.items()}
        if len(set(counts.values())) > 1:
            raise ValueError(f"the fields must hold the same number of samples, got {counts}")
        return out

    def stack_fields(self, fields: dict[str, np.ndarray]) -> np.ndarray:
        """(N, C, H, W): exactly the ``input_channels`` of checked ``fields``, in order."""
        need = list(self.input_channels)
        missing = [c for c in need if c not in fields]
        unknown = [c for c in fields if c not in need]
        if missing or unknown:
            raise ValueError(f"problem {self.name!r} needs {need}{self.fields_hint}, got "
                             f"channels {list(fields)} (missing {missing}, unknown {unknown})")
        return np.stack([fields[c] for c in need], axis=1)

    @abc.abstractmethod
    def impose(self, u: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """Apply the hard-imposed boundary/initial values (if this problem instance uses them)
        to the generator's raw output (B, 1, H, W); identity otherwise. On a split block: the
        block's parts of u and inputs (every current problem imposes pointwise, no exchange)."""

    @abc.abstractmethod
    def loss_terms(self, u: torch.Tensor, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-sample, already weighted loss terms, each of shape (B,).

        Keys are ``loss_term_names``, fixed per problem (by default "pde" and "bc"; a
        hard-imposed or natural condition gives a zero "bc"). The sample's loss is the sum.
        On a split block: this block's parts of u, inputs and of every term (module docstring).
        """

    # -- reference solutions ----------------------------------------------------------------
    def reference_solution(self, params: np.ndarray, method: str = "auto") -> np.ndarray:
        """(H, W) float64 solution of one parameter vector (k,) by the classical solver.

        ``method`` is one of ``reference_methods`` (ValueError listing them otherwise). A family
        without a classical solver sets ``reference_methods = ()`` and need not define this:
        it trains and infers, and this default says it has no reference solver.
        """
        self.check_method(method)
        raise NotImplementedError(f"{type(self).__name__} lists reference methods "
                                  f"{self.reference_methods} but does not implement "
                                  f"reference_solution")

    def solve_from_inputs(self, inputs, method: str = "auto") -> np.ndarray:
        """(H, W) float64 reference solution of one sample's input fields (C, H, W).

        ``inputs`` is a row of ``build_input`` / ``inputs_from_fields`` (numpy or torch), so a
        user's fields are solved without parameter vectors. Problems whose solver can do that
        set ``solves_from_inputs = True`` and override this; the default raises the ValueError
        of ``check_method(method, from_inputs=True)``.
        """
        self.check_method(method, from_inputs=True)
        raise NotImplementedError(f"{type(self).__name__} sets solves_from_inputs but does not "
                                  f"implement solve_from_inputs")

    def answer_residual(self, u, inputs) -> np.ndarray:
        """(B,) float64 discrete residual of answers u (B, 1, *grid) to inputs (B, C, *grid)
        on the whole grid (numpy or torch), normalised so that a boundary lift (the field
        holding only the boundary values) reads 1 and the discrete solution 0
        (``answer_check``).

        Optional: a family that has it sets ``residual_threshold``; this default (threshold
        None) raises NotImplementedError saying the family has none.
        """
        raise NotImplementedError(f"problem {self.name!r} has no answer residual (its "
                                  f"residual_threshold is None)")

    def check_answers(self, u, inputs) -> dict:
        """{"residual": (B,) float64, "flagged": (B,) bool} of answers ``u`` to ``inputs`` (as
        ``answer_residual`` takes them): flagged where the residual is above
        ``residual_threshold`` or not finite. ValueError when the family has no residual."""
        if self.residual_threshold is None:
            raise ValueError(f"problem {self.name!r} has no answer residual to check its "
                             f"answers with (its residual_threshold is None); run without "
                             f"the check")
        r = self.answer_residual(u, inputs)
        return {"residual": r, "flagged": flags(r, self.residual_threshold)}

    def check_method(self, method, *, from_inputs: bool = False) -> str:
        """``method`` if it is one of ``reference_methods`` and, with ``from_inputs``, if this
        problem solves from given fields; ValueError saying what is allowed otherwise.

        Called before any solve, so a bad choice is refused up front, not on the first sample.
        """
        if not self.reference_methods:
            raise ValueError(f"problem {self.name!r} has no reference solver (its "
                             f"reference_methods is empty)")
        if from_inputs and not self.solves_from_inputs:
            raise ValueError(
                f"solving from given input fields is not available for problem {self.name!r}: "
                f"its reference solver needs parameter vectors {self.param_names}; give "
                f"parameter vectors instead")
        return check_choice(f"the reference method of problem {self.name!r}", method,
                            self.reference_methods)

    def refine(self, inputs, u0, tol: float = 1e-8):
        """(u, info): the answer ``u0`` (*grid) to the sample of input fields ``inputs``
        (C, *grid) refined by the iterative reference solver until its relative residual is at
        most ``tol``; ``u0=None`` is the cold start (zero initial guess) of the same solver.
        info holds at least ``iterations``, ``residual``, ``initial_residual``, ``converged``
        and the seconds ``solve_time``, ``setup_time``, ``assemble_time``. Problems whose
        solver can do that set ``refines = True`` and override this; the default raises the
        ValueError of ``check_refine``."""
        self.check_refine(tol)
        raise NotImplementedError(f"{type(self).__name__} sets refines but does not implement "
                                  f"refine")

    def check_refine(self, tol) -> float:
        """``tol`` as a float in (0, 1) if this problem refines answers (``refines``);
        ValueError naming the problem otherwise. Called before any work, so a request the
        problem cannot serve is refused up front."""
        if not self.refines:
            why = ("it has no reference solver" if not self.reference_methods else
                   "its reference solver is not an iterative solver that starts from a guess")
            raise ValueError(f"problem {self.name!r} cannot refine an answer: {why}; run "
                             f"without refinement")
        return check_number("the refinement tolerance", tol, lo=0.0, hi=1.0, lo_open=True,
                            hi_open=True, what="a relative residual in (0, 1), e.g. 1e-8")

    def check_sample(self, inputs) -> np.ndarray:
        """One sample's input fields as a finite float64 array (C, *grid) on this grid."""
        want = (len(self.input_channels), *self.grid)
        form = f"(C, {grid_axes(len(self.grid))}) = {want}"
        x = check_array("inputs", inputs, ndim=len(want), form=form)
        if x.shape != want:
            raise ValueError(f"inputs of problem {self.name!r} must have shape {form} "
                             f"(channels {list(self.input_channels)}), got {x.shape}")
        return x

    def set_progress(self, fraction: float) -> None:
        """Training progress step / total_steps in [0, 1], set by the trainer before each step.

        A loss that follows a schedule (a homotopy annealed over training) reads it; the default
        loss does not depend on it. Being a function of the step, it is the same on every rank
        and after a resume.
        """

    def config(self) -> dict:
        """Constructor keyword arguments that rebuild this instance (stored in checkpoints)."""
        return {"grid": list(self.grid)}
