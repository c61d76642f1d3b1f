"""The one test-only hook into the training loop; off in every real run.

``DEEPFUSION_TEST_HOOK=MODULE`` names a module on the run's Python path with a function
``step_hook(rank)`` that returns None or a callable; the trainer calls that callable with
itself as each step starts, before any of the step's work. The test suite injects its faults
this way (an exception on one rank, a non-finite loss, a hang in native code:
``tests/faults/steps.py``), so none of them is in the product.

``train`` loads the hook on every rank before anything is built (:func:`load`, from the
preflight checks): a module that cannot be imported, or a ``ValueError`` from ``step_hook`` (its
own malformed setting), is refused as bad input, exit 2. Unset: one environment lookup at
start-up, and one test of None per step.
"""
from __future__ import annotations

import importlib
import os

ENV = "DEEPFUSION_TEST_HOOK"


def load(rank: int):
    """The callable ``step_hook(rank)`` of the module ``DEEPFUSION_TEST_HOOK`` names, or None
    (unset, or the module has nothing to do on this rank); ValueError if it cannot be loaded."""
    name = os.environ.get(ENV, "")
    if not name:
        return None
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        raise ValueError(f"{ENV}={name!r}: cannot import it ({e}); unset {ENV} in a real run") \
            from None
    return module.step_hook(rank)
