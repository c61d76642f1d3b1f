"""DiffNet: the science. Problems, finite-difference stencils, generators, losses, reference solvers.

No MPI in here: everything is single-process and deterministic, so the engine (``deepfusion``)
can wrap any of it in data parallelism without knowing which PDE it trains.
"""
