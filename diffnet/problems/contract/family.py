"""The family part of a problem: the domain, the parameters of a draw, its input fields, and
optionally a reference solver (:class:`Family`, one of the three parts of
:class:`diffnet.problems.Problem`; docs/your-own-pde.md).

A problem is a *parametric family* of PDEs on a fixed rectangular node grid. Grid convention:
a field is a tensor (B, 1, H, W) (3-D: (B, 1, D, H, W)). Rows run along ``axes[0]`` and
columns along ``axes[1]`` (Burgers: ("t", "x"), so row 0 is t=0; Poisson: ("y", "x")). Nodes
include the boundary: axis a has ``n`` nodes on ``[lo, hi]`` with spacing
``(hi - lo) / (n - 1)``.

A draw is a parameter vector (``sample_params``, deterministic in (seed, index)); the network
sees its input fields (``build_input``). Inputs given as fields (``inputs_from_fields``) and
the reference solution of given fields (``solve_from_inputs``) are part of the contract too,
so the application can run a network or a reference solver on a user's fields without knowing
which PDE (or which channel) it handles.
"""
from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from diffnet.domain import Block
from diffnet.validation import (check_array, check_choice, check_grid, check_node_grid, check_number,
                          grid_axes)
from diffnet.problems.contract.answer_check import flags
from diffnet.problems.contract.blocks import cut


@dataclass(frozen=True)
class Axis:
    """One grid axis: its name and the closed interval its nodes cover."""

    name: str
    lo: float
    hi: float


class Family(abc.ABC):
    """What a draw of the family is: geometry, parameters, input fields, reference solver.

    The optional methods, ``reference_solution``, ``solve_from_inputs``, ``refine`` and
    ``derived_channels``, are offered by defining them: :func:`has_reference`,
    :func:`solves_from_inputs`, :func:`refines` and :func:`has_derived_channels` say which a
    family defines, and the defaults here refuse, saying what the family lacks
    (``derived_channels``: none). ``answer_residual`` every Problem has (from its loss); a
    family may define its own.

    Class attributes a family sets:
        param_names: names of the k entries of a parameter vector, e.g. ("c",).
        input_channels: names of the C channels ``build_input`` returns, e.g. ("u0",) or ("nu",).
        loss_only_channels: those of ``input_channels`` the network is not meant to read, there
            for the loss and the reference solver only (e.g. a constant flow's components
            when the network sees the flow as a potential field); ``train`` does not warn
            that a network with instance norm loses them when they are spatially constant.
            Default none.
        dims: the number of grid axes (2: (H, W); 3: (D, H, W)).
        reference_methods: the ``method`` values ``reference_solution`` and
            ``solve_from_inputs`` accept; "auto" (the solver's own choice) always comes first.
            Read only where the family has a reference solver (:func:`has_reference`).
        fields_hint: optional text for the message of missing channels in
            ``inputs_from_fields``, e.g. which channels are derived from which.
        derivations: {channel: how it follows from the others, in words}, e.g.
            {"log_nu": "log(nu)"}, for the message refusing given fields whose channel is not
            what ``derived_channels`` recomputes; set with ``derived_channels``.
        residual_threshold: the ``answer_residual`` above which an answer is flagged as not to
            be trusted when its model carries no threshold calibrated on its own validation
            draws (a checkpoint written before calibration); optional, None: no fallback.
        option_presets: {option: the options its value presets}, e.g. Darcy's {"family":
            ("tau", ...)}: an option given anew over stored ones (``--set`` on a checkpoint)
            drops the stored values of those it presets (``replace_options``); default none.
    """

    name: str = ""
    param_names: tuple[str, ...] = ()
    input_channels: tuple[str, ...] = ()
    loss_only_channels: tuple[str, ...] = ()
    dims: int = 2
    reference_methods: tuple[str, ...] = ("auto",)
    fields_hint: str = ""
    residual_threshold: float | None = None
    derivations: dict[str, str] = {}
    option_presets: dict[str, tuple[str, ...]] = {}

    def __init__(self, *, grid=(64, 64)):
        # check_grid words the 2-D case as (H, W); the same check for any number of axes
        self.grid = check_grid(grid) if self.dims == 2 else check_node_grid(grid, self.dims)

    def config(self) -> dict:
        """Constructor keyword arguments that rebuild this instance (stored in checkpoints)."""
        return {"grid": list(self.grid)}

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
        """``params`` as a float64 (n, k) array; ValueError naming the expected shape otherwise
        (one vector (k,) is refused: ``np.atleast_2d`` it)."""
        params = np.asarray(params, dtype=np.float64)
        if params.ndim != 2 or params.shape[1] != len(self.param_names):
            raise ValueError(
                f"{self.name}: parameters must have shape (n, {len(self.param_names)}) "
                f"for {self.param_names}, got {params.shape}")
        return params

    # -- input fields -----------------------------------------------------------------------
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

    def derived_channels(self, inputs: np.ndarray) -> dict[str, np.ndarray]:
        """{channel: (N, *grid) float64} each channel of ``input_channels`` that follows from
        the others (a logarithm, a coordinate, a field repeated along an axis), recomputed
        from the others of ``inputs`` (N, C, *grid) float64, exactly as ``build_input``
        makes it.

        Optional: a family whose channels are not independent defines it (and
        ``derivations``), and every prediction from given fields (``predict(inputs)``,
        ``infer --inputs``) compares the given channels with these and refuses a mismatch
        beyond float32 rounding (:mod:`.derived`). This default derives nothing. Keep it
        cheap: it runs on every given sample."""
        return {}

    def check_sample(self, inputs) -> np.ndarray:
        """One sample's input fields as a finite float64 array (C, *grid) on this grid."""
        want = (len(self.input_channels), *self.grid)
        form = f"(C, {grid_axes(len(self.grid))}) = {want}"
        x = check_array("inputs", inputs, ndim=len(want), form=form)
        if x.shape != want:
            raise ValueError(f"inputs of problem {self.name!r} must have shape {form} "
                             f"(channels {list(self.input_channels)}), got {x.shape}")
        return x

    # -- reference solutions ----------------------------------------------------------------
    def reference_solution(self, params: np.ndarray, method: str = "auto") -> np.ndarray:
        """(H, W) float64 solution of one parameter vector (k,) by the classical solver.

        ``method`` is one of ``reference_methods`` (ValueError listing them otherwise). A family
        without a classical solver does not define this: it trains and infers, and this
        default says it has no reference solver.
        """
        self.check_method(method)
        raise NotImplementedError(f"{type(self).__name__}.reference_solution reached the "
                                  f"contract's default, which has no solver")

    def solve_from_inputs(self, inputs, method: str = "auto") -> np.ndarray:
        """(H, W) float64 reference solution of one sample's input fields (C, H, W).

        ``inputs`` is a row of ``build_input`` / ``inputs_from_fields`` (numpy or torch), so a
        user's fields are solved without parameter vectors. Problems whose solver can do that
        define this; the default raises the ValueError of
        ``check_method(method, from_inputs=True)``.
        """
        self.check_method(method, from_inputs=True)
        raise NotImplementedError(f"{type(self).__name__}.solve_from_inputs reached the "
                                  f"contract's default, which has no solver")

    def check_method(self, method, *, from_inputs: bool = False) -> str:
        """``method`` if it is one of ``reference_methods`` and, with ``from_inputs``, if this
        problem solves from given fields; ValueError saying what is allowed otherwise.

        Called before any solve, so a bad choice is refused up front, not on the first sample.
        """
        if not has_reference(self):
            raise ValueError(f"problem {self.name!r} has no reference solver (it does not "
                             f"define reference_solution)")
        if from_inputs and not solves_from_inputs(self):
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
        solver can do that define this; the default raises the ValueError of
        ``check_refine``."""
        self.check_refine(tol)
        raise NotImplementedError(f"{type(self).__name__}.refine reached the contract's "
                                  f"default, which has no solver")

    def check_refine(self, tol) -> float:
        """``tol`` as a float in (0, 1) if this problem refines answers (:func:`refines`);
        ValueError naming the problem otherwise. Called before any work, so a request the
        problem cannot serve is refused up front."""
        if not refines(self):
            why = ("it has no reference solver" if not has_reference(self) else
                   "its reference solver is not an iterative solver that starts from a guess")
            raise ValueError(f"problem {self.name!r} cannot refine an answer: {why}; run "
                             f"without refinement")
        return check_number("the refinement tolerance", tol, lo=0.0, hi=1.0, lo_open=True,
                            hi_open=True, what="a relative residual in (0, 1), e.g. 1e-8")

    def answer_residual(self, u, inputs) -> np.ndarray:
        """(B,) float64 discrete residual of answers u (B, 1, *grid) to inputs (B, C, *grid)
        on the whole grid (numpy or torch), normalised so that a boundary lift (the field
        holding only the boundary values) reads 1 and the discrete solution 0
        (``answer_check``).

        Every :class:`~diffnet.problems.Problem` has one, derived from its loss
        (``Problem.answer_residual``, :mod:`.loss_residual`); a family may define its own,
        which wins. This default, of a family that is no Problem, raises NotImplementedError.
        """
        raise NotImplementedError(f"problem {self.name!r} has no answer residual (it does not "
                                  f"define answer_residual)")

    def check_answers(self, u, inputs, threshold: float | None = None) -> dict:
        """{"residual": (B,) float64, "flagged": (B,) bool} of answers ``u`` to ``inputs`` (as
        ``answer_residual`` takes them): flagged where the residual is above ``threshold``
        (default the family's ``residual_threshold``; neither: no threshold, only non-finite
        answers are flagged) or not finite. ValueError when the problem has no residual."""
        if not has_answer_residual(self):
            raise ValueError(f"problem {self.name!r} has no answer residual to check its "
                             f"answers with (it does not define answer_residual); run without "
                             f"the check")
        r = self.answer_residual(u, inputs)
        return {"residual": r,
                "flagged": flags(r, self.residual_threshold if threshold is None else threshold)}


# ---------------------------------------------------------------------------------------------
# what a family offers: the optional methods it defines
# ---------------------------------------------------------------------------------------------

def defines(problem, method: str) -> bool:
    """Whether ``problem`` (a class or an instance) defines ``method`` itself instead of
    inheriting the contract's default from :class:`Family`."""
    cls = problem if isinstance(problem, type) else type(problem)
    return getattr(cls, method, None) is not getattr(Family, method)


def has_reference(problem) -> bool:
    """Whether a problem (class or instance) has a reference solver: it defines
    ``reference_solution``. Without one it trains and infers; solve, compare and the error
    of evaluate are refused."""
    return defines(problem, "reference_solution")


def solves_from_inputs(problem) -> bool:
    """Whether its reference solver solves given input fields: it defines
    ``solve_from_inputs`` (and has a reference solver)."""
    return has_reference(problem) and defines(problem, "solve_from_inputs")


def refines(problem) -> bool:
    """Whether it refines an approximate answer with its iterative reference solver: it
    defines ``refine`` (and has a reference solver)."""
    return has_reference(problem) and defines(problem, "refine")


def has_answer_residual(problem) -> bool:
    """Whether it measures how far an answer is from the discrete solution: it defines
    ``answer_residual``, as every :class:`~diffnet.problems.Problem` does (derived from its
    loss, unless the family defines its own: ``residual_kind``)."""
    return defines(problem, "answer_residual")


def has_derived_channels(problem) -> bool:
    """Whether some of its input channels follow from the others and given fields are checked
    for it: it defines ``derived_channels``."""
    return defines(problem, "derived_channels")


def check_reference(problem, what: str) -> None:
    """ValueError saying that ``problem`` has no reference solver, so ``what`` cannot be done."""
    if not has_reference(problem):
        raise ValueError(f"problem {problem.name!r} has no reference solver (it does not "
                         f"define reference_solution), so {what}; 'deepfusion evaluate "
                         f"RUN_DIR' reports the loss and its terms on test draws instead")
