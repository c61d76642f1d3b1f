"""A family without a reference solver that splits over a domain: the built-in Poisson family
reused through the public API, declaring no reference solver (tests/test_plugin_problems.py)."""
from __future__ import annotations

from diffnet.problems import Poisson, Problem


class PoissonWithoutReference(Poisson):
    """The Poisson family of ``diffnet.problems.Poisson`` with no reference solver."""

    name = "poisson_no_reference"
    reference_solution = Problem.reference_solution   # the contract's default: none
