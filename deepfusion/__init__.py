"""DeepFusion: the engine that trains DiffNet generators data-parallel on CPU clusters.

``deepfusion.load(path)`` returns a trained checkpoint as a :class:`~deepfusion.app.solver.Solver`
(docs/python-api.md). ``import deepfusion`` stays light: torch is imported by ``load``, so a
command can set the thread layout first.
"""
from deepfusion.version import __version__

__all__ = ["load", "Solver", "__version__"]


def load(*args, **kwargs):
    """The solver of a checkpoint or a run directory: see :func:`deepfusion.app.solver.load`."""
    from deepfusion.app.solver import load as load_solver

    return load_solver(*args, **kwargs)


def __getattr__(name):
    if name == "Solver":
        from deepfusion.app.solver import Solver

        return Solver
    raise AttributeError(f"module 'deepfusion' has no attribute {name!r}")
