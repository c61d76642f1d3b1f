"""The loss part of a problem: boundary imposition and per-sample loss terms, and the
split-exact helpers that make both exact on a block of a split grid (:class:`Loss`, one of the
three parts of :class:`diffnet.problems.Problem`; docs/your-own-pde.md).

Losses are returned *per sample* (shape (B,)) and already weighted, so that the total loss of a
sample is ``sum(terms.values())``. The engine sums them over the local batch, all-reduces the
sums and divides by the global batch size: the mean over the global batch, whatever the number
of ranks.

Domain parallelism (``diffnet.domain``): a problem holds ``self.block``, the block of the node
grid it computes on (``Block(grid)``, the whole grid, unless ``on_block`` set another). On a
split block, ``impose(u, inputs)``, the answer head and ``loss_terms(u, inputs)`` receive the
BLOCK'S PART of u and of the inputs (built for the global grid and cut with ``block.local``),
and every returned per-sample term is this block's PART: the sum over the blocks of each term
equals the undivided term, value and gradient (up to rounding; the collectives' backward
carries the gradient across blocks, so every block must backpropagate its whole loss, all
terms together, as the engine does). A loss written with the split-exact helpers has that
property with no block code (:mod:`.blocks`; each is a method here): derivatives by
``FiniteDifference(u, self.block)``, means over nodes by ``self.mean(t, interior)``, boundary
terms by ``self.wall_mean(t, axis, side)``, quantities on edges by ``self.edges(t)``, global
masks and weights cut by ``self.part``, non-linear reductions by ``self.total`` and
``self.share``; a plain sum over nodes needs nothing. A term written otherwise is declared in
``unsplit_terms`` (``on_block`` then refuses a split naming it), and options that cannot split
are refused by ``check_block`` with a ValueError saying why.
"""
from __future__ import annotations

import abc

import torch

from diffnet.domain import Block
from diffnet.problems.contract.blocks import cut, edges, node_mean, share, total, wall_mean


class Loss(abc.ABC):
    """How a network output is made admissible and scored, on ``self.block`` of ``self.grid``.

    Class attributes a loss sets:
        loss_term_names: the keys of ``loss_terms``, in the order they are logged.
        unsplit_terms: the loss terms NOT written with the split-exact helpers (default none):
            a split block is refused naming them (an instance may set it by its options).
        detached_terms: the loss terms that hold part of their value fixed on purpose (a
            target with no gradient through it): their autograd gradient is not the
            derivative of their value, so the checker's gradient check leaves them out and
            says so (default none; an instance may set it by its options).
    """

    loss_term_names: tuple[str, ...] = ("pde", "bc")
    unsplit_terms: tuple[str, ...] = ()
    detached_terms: tuple[str, ...] = ()
    block: Block

    @abc.abstractmethod
    def impose(self, u: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """Apply the hard-imposed boundary/initial values (if this problem instance uses them)
        to the generator's raw output (B, K, *grid), each of the K fields alike (K = 1 but for
        an answer head that combines fields); identity otherwise. On a split block: the
        block's parts of u and inputs (every current problem imposes pointwise, no exchange)."""

    @abc.abstractmethod
    def loss_terms(self, u: torch.Tensor, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-sample, already weighted loss terms of the answer u (B, 1, *grid), each (B,).

        Keys are ``loss_term_names``, fixed per problem (by default "pde" and "bc"; a
        hard-imposed or natural condition gives a zero "bc"). The sample's loss is the sum.
        On a split block: this block's parts of u, inputs and of every term (module docstring).
        """

    def set_progress(self, fraction: float) -> None:
        """Training progress step / total_steps in [0, 1], set by the trainer before each step.

        A loss that follows a schedule (a homotopy annealed over training) reads it; the default
        loss does not depend on it. Being a function of the step, it is the same on every rank
        and after a resume.
        """

    # -- domain parallelism ------------------------------------------------------------------
    def on_block(self, block: Block):
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
                f"diffnet.problems.contract.blocks): run without a domain split (parallel.domain = []), "
                f"or write them with the helpers (docs/your-own-pde.md)")
        self.check_block(block)

    def check_block(self, block: Block) -> None:
        """ValueError if this problem cannot compute its losses on the split ``block``
        (called by ``on_block``; the default accepts every block)."""

    def part(self, field: torch.Tensor) -> torch.Tensor:
        """This block's part of a global field (..., *grid), grid axes of size 1 broadcast
        (masks, weights); the field itself when undivided. A view, no copy."""
        return cut(self.block, field)

    # -- split-exact helpers (diffnet.problems.contract.blocks): a loss written with them splits ------
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
        this block owns, t (B, C, *grid): each edge of the grid once over the blocks. ``t`` a
        tuple of fields gives tuples, per axis ((u0, a0), (u1, a1)) for t = (u, a)."""
        return edges(self.block, t, axes)

    def total(self, part: torch.Tensor) -> torch.Tensor:
        """The sum over the blocks of per-sample partial sums ``part`` (B,), on every block:
        the inside of a non-linear reduction; return a function of it through ``share``."""
        return total(self.block, part)

    def share(self, value: torch.Tensor) -> torch.Tensor:
        """This block's share of a value every block holds (a function of ``total``)."""
        return share(self.block, value)
