"""Plugin families broken in their loss (tests/test_boundary_families.py): check-problem's
failures name this file and the line of the method at fault."""
from __future__ import annotations

from diffnet.problems import neumann
from tests.plugins.boundary_families import FluxPlate


class Misshapen(FluxPlate):
    """Terms of shape (B, 1), not (B,)."""

    def loss_terms(self, u, inputs):                        # check-problem: a wrong return
        return {k: v[:, None] for k, v in super().loss_terms(u, inputs).items()}


class NoSuchWall(FluxPlate):
    """A Neumann wall the problem does not have."""

    def loss_terms(self, u, inputs):
        terms = super().loss_terms(u, inputs)
        bc = neumann(self, u, inputs[:, 1:2], walls="right")   # check-problem: it raised here
        return {**terms, "bc": bc}
