"""Accuracy metrics of predicted fields against reference solutions."""
from __future__ import annotations

import numpy as np


def relative_l2(pred, ref) -> np.ndarray:
    """Relative L2 error ||pred - ref||_2 / ||ref||_2 per sample.

    Accepts (H, W) or (N, H, W) (or (N, 1, H, W)) arrays; returns a float or an (N,) array.
    A reference that is identically zero gives the absolute L2 norm of the prediction.
    """
    p = np.asarray(pred, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    if p.shape != r.shape:
        raise ValueError(f"relative_l2: shapes differ, pred {p.shape} vs ref {r.shape}")
    single = p.ndim == 2
    p = p.reshape(1 if single else p.shape[0], -1)
    r = r.reshape(p.shape)
    num = np.linalg.norm(p - r, axis=1)
    den = np.linalg.norm(r, axis=1)
    out = np.where(den > 0, num / np.where(den > 0, den, 1.0), num)
    return float(out[0]) if single else out


def max_error(pred, ref) -> np.ndarray:
    """Max absolute pointwise error per sample (same shapes as relative_l2)."""
    p = np.asarray(pred, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    if p.shape != r.shape:
        raise ValueError(f"max_error: shapes differ, pred {p.shape} vs ref {r.shape}")
    if p.ndim == 2:
        return float(np.abs(p - r).max())
    return np.abs(p - r).reshape(p.shape[0], -1).max(axis=1)
