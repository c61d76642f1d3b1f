"""The answer-head part of a problem: how the answer (B, 1, *grid) is formed from the K fields
the network outputs, once the loss part has imposed the boundary values on each of them
(:class:`AnswerHead`; one of the three parts of :class:`diffnet.problems.Problem`,
docs/your-own-pde.md).

``Plain`` (the default of every problem): one field, the answer is the imposed field.
``Ritz(fields=K, partition=m)``: the minimiser of the problem's quadratic energy in the span of
the K imposed fields (m = 0), or of the K fields times the hats of an m x m coarse partition
(m > 0); the numerics are :mod:`.ritz`. What a Ritz head needs of the problem is the small
public interface :class:`QuadraticEnergy`, so a user's quadratic-energy PDE uses it as the
built-in ``ReactionDiffusion`` and ``Darcy`` do (``ritz = true``).

A head holds no state of a problem: it is given the problem at each call, so one head may
serve problems on several grids (a Ritz head keeps the partition of each grid it has seen).
"""
from __future__ import annotations

import abc

import torch

from diffnet.validation import check_int
from diffnet.problems.contract.ritz import Partition, partition_combination, ritz_combination


class AnswerHead(abc.ABC):
    """Forms the answer (B, 1, *grid) from the ``channels`` imposed fields (B, K, *grid)."""

    channels: int = 1
    # Why a graph format (ONNX) cannot hold this head, in words: a Python branch on a computed
    # value, which a traced graph cannot keep; None where the head knows of none. Export
    # refuses before tracing (which takes long and would only stop at the branch).
    graph_branch: str | None = None

    @abc.abstractmethod
    def form(self, u: torch.Tensor, inputs: torch.Tensor, problem) -> torch.Tensor:
        """(B, 1, *grid) the answer from the imposed fields u (B, channels, *grid) and the
        input fields (B, C, *grid) of ``problem``; on a split block, this block's part of
        all three (the head reduces over the blocks with ``problem.total`` where it must)."""

    def check(self, problem) -> None:
        """ValueError if this head cannot form the answers of ``problem`` (what the problem
        lacks and how to fix it); the default accepts every problem."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Plain(AnswerHead):
    """One field; the answer is the imposed field itself."""

    channels = 1

    def form(self, u: torch.Tensor, inputs: torch.Tensor, problem) -> torch.Tensor:
        return u


class QuadraticEnergy(abc.ABC):
    """What a Ritz head needs of a problem whose loss is the energy E(u) = a(u, u) / 2 - l(u)
    (a symmetric positive semi-definite form a, a linear form l) on the fields ``impose``
    makes admissible, a linear space (homogeneous boundary values, e.g. a mask multiply).

    A problem class lists this mixin beside ``Problem`` and implements:

    * ``quadratic_features(u, inputs)``: the quadratic part as weighted squares, a list of
      pairs (F, w) with a(v, v) / 2 = sum over the pairs of sum(w * F(v)^2) for each field v.
      u holds the K fields of each sample (B, K, *grid), in the dtype the head works in (the
      fields' own; float64 for a partition); F is linear in u, shaped (B, K, ...), and w >= 0
      (a tensor broadcasting to F, or a number) depends on the inputs only. For a partition
      (2-D) each feature is local: its last two axes index the grid's nodes, or its edges
      (i, i + 1) by i, and an entry depends on its own node or edge only (two-point
      differences, nodal terms).
    * ``load(inputs, like)``: the nodal weights of l, l(v) = sum over the nodes of load * v,
      broadcasting to (B, 1, *grid), in ``like``'s dtype.

    Optional: ``linear_form(u, inputs)``, (B, K) l of each field (default: from ``load``), and
    ``quadratic_features_window(u, inputs, start, stop)``: the pairs of the edges and nodes a
    window owns, for u cut to the nodes [start, stop] of each axis of the whole grid (a
    partition then assembles its Gram matrix cell by cell in cache; default None: not offered).

    On a split block every method returns this block's part (``self.part`` of global weights,
    ``self.edges`` for edges), as the loss does; the head sums over the blocks. The loss must
    be this energy: training differentiates the answer at fixed coefficients, which is exact
    only where the coefficients minimise the loss (:mod:`.ritz`); ``deepfusion check-problem``
    checks that the answer is stationary for the loss.
    """

    quadratic_features_window = None

    @abc.abstractmethod
    def quadratic_features(self, u: torch.Tensor, inputs: torch.Tensor) -> list:
        """The pairs (F, w) of a(u, u) / 2 for the K fields of u (B, K, *grid)."""

    @abc.abstractmethod
    def load(self, inputs: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The nodal weights of l, broadcasting to (B, 1, *grid), in ``like``'s dtype."""

    def linear_form(self, u: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """(B, K) l(u_i) of the K fields of u (B, K, *grid): sum of ``load`` times the field."""
        return (u * self.load(inputs, u)).flatten(2).sum(2)


class Ritz(AnswerHead):
    """The Ritz-Galerkin answer of a :class:`QuadraticEnergy` problem from ``fields`` K fields:
    the energy's minimiser in their span (``partition`` m = 0), or in the span of the fields
    times the (m + 1)^2 bilinear hats of an m x m coarse grid (m > 0, 2-D), found per sample by
    a small float64 solve (:mod:`.ritz`). The coefficients are constants to autograd."""

    def __init__(self, fields: int = 1, partition: int = 0):
        self.channels = check_int("the Ritz head's fields", fields, 1)
        self.partition = check_int("the Ritz head's partition", partition, 0)
        self._partitions: dict = {}

    def __repr__(self) -> str:
        return f"Ritz(fields={self.channels}, partition={self.partition})"

    @property
    def graph_branch(self) -> str | None:
        """One coefficient is a division; more are a Gram solve (``ritz.solve_gram``) that
        falls back from Cholesky to LU where Cholesky fails to rounding."""
        if self.channels == 1 and not self.partition:
            return None
        return ("its Gram solve (solve_gram in diffnet/problems/contract/ritz.py) falls back "
                "from Cholesky to LU where Cholesky fails to rounding, a branch on a computed "
                "value")

    def check(self, problem) -> None:
        if not isinstance(problem, QuadraticEnergy):
            raise ValueError(
                f"answer head {self!r} needs a problem with a quadratic energy, but "
                f"{type(problem).__name__} is not a diffnet.problems.QuadraticEnergy: list it "
                f"among the class's bases and implement quadratic_features and load "
                f"(docs/your-own-pde.md), or use the Plain head")
        if self.partition:
            self.partition_of(problem.grid)

    def partition_of(self, grid) -> Partition:
        """The coarse partition of ``grid`` (built once per grid); ValueError if it has none."""
        grid = tuple(grid)
        if grid not in self._partitions:
            if len(grid) != 2 or self.partition > min(grid) - 1:
                raise ValueError(
                    f"answer head {self!r}: a partition of {self.partition} x "
                    f"{self.partition} cells needs a 2-D grid of at least "
                    f"{self.partition + 1} nodes per axis, got {list(grid)}; use a smaller "
                    f"partition")
            self._partitions[grid] = Partition(grid, self.partition)
        return self._partitions[grid]

    def form(self, u: torch.Tensor, inputs: torch.Tensor, problem) -> torch.Tensor:
        if not isinstance(problem, QuadraticEnergy):
            self.check(problem)
        # a half-precision network output is combined in float32 (the solve itself in float64)
        x = inputs.to(torch.float32 if u.dtype in (torch.float16, torch.bfloat16) else u.dtype)

        def features(v):        # a weight given as a number becomes a tensor of F's dtype
            return [(f, w if isinstance(w, torch.Tensor) else torch.tensor(w, dtype=f.dtype))
                    for f, w in problem.quadratic_features(v, x)]
        if self.partition:
            return self.partition_answer(u, x, problem, features)
        b, k = u.shape[:2]

        def ell(flat):      # ritz_combination's l of the B K fields as one (B K, 1, *grid) batch
            return problem.linear_form(flat.view(b, k, *flat.shape[2:]), x).reshape(-1)
        return ritz_combination(u, features, ell, problem.total)

    def partition_answer(self, u, x, problem, features) -> torch.Tensor:
        """The answer with coefficient fields on the partition (``partition_combination``)."""
        window = None
        if problem.quadratic_features_window is not None and problem.block.whole:
            xd = x.double()     # float64 as the partition works: converted once, not per cell

            def window(v, start, stop):
                return problem.quadratic_features_window(v, xd, start, stop)
        return partition_combination(u, features, problem.load(x, u), problem.total,
                                     self.partition_of(problem.grid), problem.block,
                                     window_features=window)
