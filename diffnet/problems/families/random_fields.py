"""Spectral Gaussian random fields on the unit square: the Darcy family's coefficient draws.

A draw is its cosine coefficients, so the same draw renders on any node grid::

    mu(y, x) = sum_{l, k = 0 .. M-1}  c_lk  phi_l(y) phi_k(x),
    phi_0 = 1,  phi_k(t) = sqrt(2) cos(k pi t)   (k >= 1),
    c_lk = sigma_lk xi_lk,  xi_lk ~ N(0, 1) independent,  c_00 = 0,
    sigma_lk = tau^(alpha - 1) (pi^2 (l^2 + k^2) + tau^2)^(-alpha / 2).

The phi_l(y) phi_k(x) are the L2-orthonormal eigenfunctions of the Laplacian on [0, 1]^2 with
zero Neumann conditions (eigenvalues -pi^2 (l^2 + k^2)), so mu is the Karhunen-Loeve expansion,
truncated at M modes per axis, of the Gaussian measure N(0, tau^(2 alpha - 2) (-Laplacian +
tau^2 I)^(-alpha)) with its constant mode removed. This is the convention of the data generator
of the Fourier Neural Operator's Darcy benchmark (Li et al., 2020, ``GRF.m``): there
``coef = tau^(alpha-1) (pi^2 (K1^2 + K2^2) + tau^2)^(-alpha/2)``, ``L = s coef xi``,
``L(1,1) = 0`` and ``U = idct2(L)``; Matlab's orthonormal inverse DCT-II on s points multiplies
the (l, k) term by s w_l w_k = 1, sqrt(2) or 2 (w_0 = s^-1/2, w_k = (2/s)^1/2), which is exactly
phi_l phi_k above evaluated at the cell centres t = (n + 1/2) / s. Here the series is evaluated
at the nodes of the problem's grid instead, and truncated at M modes instead of s. The factor
tau^(alpha - 1) does not change the sign of mu (the thresholded coefficient) but sets the
amplitude of the log-normal one.

Draw order (``xi_stream_positions``): the standard normals of one draw are generated as one
stream and assigned to the modes shell by shell (all modes with max(l, k) = s before s + 1), so
the draw with M modes is the draw with M' > M modes truncated: the truncation can be studied on
the same draws.
"""
from __future__ import annotations

import numpy as np

__all__ = ["grf_scales", "xi_stream_positions", "draw_coefficients", "cosine_basis",
           "render"]


def grf_scales(modes: int, tau: float, alpha: float) -> np.ndarray:
    """(M, M) standard deviations sigma_lk of the coefficients (sigma_00 = 0: zero mean mode)."""
    k = np.arange(modes, dtype=np.float64)
    k2 = k[:, None] ** 2 + k[None, :] ** 2
    sigma = tau ** (alpha - 1.0) * (np.pi ** 2 * k2 + tau ** 2) ** (-alpha / 2.0)
    sigma[0, 0] = 0.0
    return sigma


def xi_stream_positions(modes: int) -> np.ndarray:
    """(M, M) index into the normal stream of each mode (l, k): shell s = max(l, k) takes
    positions s^2 .. (s+1)^2 - 1, first (s, 0..s), then (0..s-1, s)."""
    l, k = np.meshgrid(np.arange(modes), np.arange(modes), indexing="ij")
    s = np.maximum(l, k)
    return s * s + np.where(l == s, k, s + 1 + l)


def draw_coefficients(seed: int, indices, modes: int, tau: float, alpha: float) -> np.ndarray:
    """(n, M * M) float64 coefficients c (row-major over (l, k)) of the draws ``indices``.

    Draw i depends only on (seed, i): its own generator ``default_rng([seed, i])``, as in
    ``Problem.sample_params``, so a rank asking for a subset gets the same draws.
    """
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if idx.size and idx.min() < 0:
        raise ValueError(f"sample indices must be >= 0, got min {idx.min()}")
    sigma = grf_scales(modes, tau, alpha)
    pos = xi_stream_positions(modes)
    out = np.empty((idx.size, modes * modes), dtype=np.float64)
    for j, i in enumerate(idx):
        xi = np.random.default_rng([int(seed), int(i)]).standard_normal(modes * modes)
        out[j] = (sigma * xi[pos]).ravel()
    return out


def cosine_basis(modes: int, t) -> np.ndarray:
    """(len(t), M) values phi_k(t_j) of the orthonormal Neumann cosines at the points t."""
    t = np.asarray(t, dtype=np.float64).reshape(-1, 1)
    phi = np.sqrt(2.0) * np.cos(np.pi * t * np.arange(modes))
    phi[:, 0] = 1.0
    return phi


def render(coeffs, y, x) -> np.ndarray:
    """(n, len(y), len(x)) float64 mu at the points (y_i, x_j) of draws ``coeffs`` (n, M * M).

    Separable: Phi_y C Phi_x^T, two matrix products per draw (O(H M^2 + H W M) flops), so a
    1024 x 1024 rendering of 32 x 32 modes costs ~35 MFLOP. Exact at any point set: no FFT
    grid, no interpolation.
    """
    c = np.asarray(coeffs, dtype=np.float64)
    m = int(round(np.sqrt(c.shape[-1])))
    if c.ndim != 2 or m * m != c.shape[1]:
        raise ValueError(f"coefficients must have shape (n, M * M), got {c.shape}")
    c = c.reshape(-1, m, m)
    return cosine_basis(m, y) @ c @ cosine_basis(m, x).T

