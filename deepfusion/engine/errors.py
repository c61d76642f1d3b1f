"""The failures the engine raises on purpose. The application maps each to an exit code
(:mod:`deepfusion.app.policy`); the engine never exits by itself.

Every class is raised on all ranks together (the decision was taken on all-reduced or broadcast
values), so no rank is left waiting in a collective.
"""
from __future__ import annotations


class InputError(Exception):
    """Bad user input (config, CLI, files) found before training, raised on every rank."""


class NonFiniteLoss(RuntimeError):
    """The global loss or gradient is not finite and cannot (or may no longer) be rolled back."""


class ParametersDiverged(RuntimeError):
    """Ranks' parameters differ: a bug, never a user error."""


class Preempted(Exception):
    """A stop signal arrived or train.time_limit_minutes passed; a checkpoint was written:
    requeue the job with --resume."""
