"""Test plugins named the way a user names their own PDE: ``"tests.plugins.heat:Heat"``.

``Heat`` is the example family of ``examples/heat.py`` (public contract only, outside diffnet);
``HeatWithoutReference`` is the same family declaring no reference solver; ``HeatWholeGrid``
the same family declaring its loss term "pde" whole-grid only (``unsplit_terms``).
"""
from __future__ import annotations

from diffnet.problems import Problem
from examples.heat import Heat

__all__ = ["Heat", "HeatWholeGrid", "HeatWithoutReference"]


class HeatWithoutReference(Heat):
    """The family of ``Heat`` without a reference solver (``reference_solution`` is the
    contract's default): it trains and infers; solve and compare refuse it, evaluate reports
    the loss and its terms.

    ``amplitude_range`` is the interval both amplitudes are drawn from (default (0.5, 1.5)).
    """

    name = "heat_no_reference"
    reference_solution = Problem.reference_solution   # the contract's default: none


class HeatWholeGrid(Heat):
    """The family of ``Heat`` declaring its term "pde" whole-grid only: a split is refused.

    ``amplitude_range`` is the interval both amplitudes are drawn from (default (0.5, 1.5)).
    """

    name = "heat_whole_grid"
    unsplit_terms = ("pde",)
