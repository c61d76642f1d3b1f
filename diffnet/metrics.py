"""Accuracy metrics of predicted fields against reference solutions."""
from __future__ import annotations

import numpy as np


def _per_sample(name: str, pred, ref, dims: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """(pred, ref) as float64 (N, n_nodes) rows and whether the input was a single sample.

    ``dims`` is the number of grid axes: an array with ``dims`` dimensions is one field
    (H, W) or (D, H, W); with more, its first axis counts the samples ((N, *grid) or
    (N, 1, *grid))."""
    p = np.asarray(pred, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    if p.shape != r.shape:
        raise ValueError(f"{name}: shapes differ, pred {p.shape} vs ref {r.shape}")
    if dims not in (1, 2, 3) or p.ndim < dims:
        raise ValueError(f"{name}: dims = {dims} grid axes, but the fields have shape {p.shape} "
                         f"(give dims = the problem's number of grid axes, 1 to 3)")
    single = p.ndim == dims
    p = p.reshape(1 if single else p.shape[0], -1)
    return p, r.reshape(p.shape), single


def relative_l2(pred, ref, *, dims: int = 2) -> np.ndarray:
    """Relative L2 error ||pred - ref||_2 / ||ref||_2 per sample.

    Accepts one field (``dims`` dimensions: (H, W), or (D, H, W) with ``dims=3``) or a batch
    (N, *grid) or (N, 1, *grid); returns a float or an (N,) array. Batches need no ``dims``:
    (N, D, H, W) is a batch with the default too. A reference that is identically zero gives
    the absolute L2 norm of the prediction.
    """
    p, r, single = _per_sample("relative_l2", pred, ref, dims)
    num = np.linalg.norm(p - r, axis=1)
    den = np.linalg.norm(r, axis=1)
    out = np.where(den > 0, num / np.where(den > 0, den, 1.0), num)
    return float(out[0]) if single else out


def max_error(pred, ref, *, dims: int = 2) -> np.ndarray:
    """Max absolute pointwise error per sample (same shapes and ``dims`` as relative_l2)."""
    p, r, single = _per_sample("max_error", pred, ref, dims)
    out = np.abs(p - r).max(axis=1)
    return float(out[0]) if single else out
