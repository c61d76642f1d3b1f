"""The RNG states a checkpoint carries: torch's CPU generator, numpy's and Python's ``random``,
captured as plain values (a uint8 tensor, JSON-able dicts and tuples) and restored exactly.

Re-exported by :mod:`deepfusion.engine.checkpoint.store`, which stores them. No MPI, no HDF5.
"""
from __future__ import annotations

import random

import numpy as np
import torch


def capture_rng_state(np_generator: np.random.Generator | None = None) -> dict:
    """The torch CPU, numpy and python ``random`` states, ready for ``save_checkpoint``.

    ``np_generator``: a ``numpy.random.Generator`` whose bit-generator state is captured (a
    JSON-able dict); without it the legacy global ``numpy.random`` state is captured.
    """
    return {
        "torch": torch.get_rng_state(),
        "numpy": (np_generator.bit_generator.state if np_generator is not None
                  else np.random.get_state()),
        "python": random.getstate(),
    }


def restore_rng_state(state: dict, np_generator: np.random.Generator | None = None) -> None:
    """Inverse of :func:`capture_rng_state` (missing entries are left alone)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        if np_generator is not None:
            np_generator.bit_generator.state = state["numpy"]
        else:
            np.random.set_state(tuple(state["numpy"]))
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))


__all__ = ["capture_rng_state", "restore_rng_state"]
