"""Shared pieces of the elliptic problems: the KL-type log-normal diffusivity and quadrature.

Diffusivity (Poisson and reaction-diffusion)::

    nu(x, y; omega) = exp( sum_{i=1..m} omega_i * lambda_i * xi_i(x) * eta_i(y) ),
    xi_i(x) = cos(k_i pi x / Lx),   eta_i(y) = cos(l_i pi y / Ly),
    lambda_i = 1 / (1 + k_i^2 + l_i^2).

The modes (k_i, l_i) run over the integer pairs != (0, 0), ordered by frequency k^2 + l^2,
ties broken by k (so (0,1), (1,0), (1,1), (0,2), (2,0), (1,2), (2,1), (2,2), (0,3), ...).
The cosines satisfy the zero-flux condition of the Poisson problem's y-walls (a smooth, even
reflection of the field) and lambda_i decays like an algebraic spectrum, as in a KL expansion of
a smooth covariance. Every mode has amplitude <= 1, so

    |log nu| <= max|omega| * sum_i lambda_i,

and the bound is attained at a domain corner (all cosines are +-1 there). With omega in [-3, 3]:
m = 4 gives sum lambda = 1/2 + 1/2 + 1/3 + 1/5 = 1.533, |log nu| <= 4.6, nu in [0.010, 99.5];
m = 6 gives sum lambda = 1.733, |log nu| <= 5.2, nu in [0.0055, 181]. Typical samples are much
milder (the terms rarely align), but the family does contain contrasts of 10^4.

Quadrature: ``trapezoid_weights`` gives the nodal weights of the composite trapezoidal rule on the
node grid (boundary nodes half, corners a quarter), normalised by the domain area so that a
weighted sum is the *mean* of the integrand (O(1), independent of the grid size).
"""
from __future__ import annotations

import math

import numpy as np
import torch


def kl_modes(n_terms: int) -> list[tuple[int, int]]:
    """The first ``n_terms`` frequency pairs (k, l) (k along x, l along y), by k^2 + l^2 then k."""
    n = int(math.isqrt(int(n_terms))) + 2
    pairs = [(k, l) for k in range(n + 1) for l in range(n + 1) if (k, l) != (0, 0)]
    pairs.sort(key=lambda p: (p[0] ** 2 + p[1] ** 2, p[0]))
    return pairs[:n_terms]


def kl_eigenvalues(n_terms: int) -> np.ndarray:
    """lambda_i = 1 / (1 + k_i^2 + l_i^2) of the first ``n_terms`` modes."""
    return np.array([1.0 / (1.0 + k * k + l * l) for k, l in kl_modes(n_terms)])


def log_diffusivity(omega: np.ndarray, y: np.ndarray, x: np.ndarray,
                    lengths=(1.0, 1.0)) -> np.ndarray:
    """log nu on the node grid: omega (n, m) -> (n, len(y), len(x)) float64."""
    omega = np.asarray(omega, dtype=np.float64)
    m = omega.shape[1]
    ly, lx = lengths
    modes = kl_modes(m)
    lam = kl_eigenvalues(m)
    # basis (m, H, W): lambda_i * cos(l pi y) cos(k pi x)
    basis = np.stack([lam[i] * np.outer(np.cos(l * np.pi * np.asarray(y) / ly),
                                        np.cos(k * np.pi * np.asarray(x) / lx))
                      for i, (k, l) in enumerate(modes)])
    return np.tensordot(omega, basis, axes=(1, 0))


def log_nu_bound(n_terms: int, omega_range) -> float:
    """max |log nu| over the family (attained at a corner)."""
    return float(max(abs(omega_range[0]), abs(omega_range[1])) * kl_eigenvalues(n_terms).sum())


def trapezoid_weights(grid, dtype=torch.float64) -> torch.Tensor:
    """(H, W) trapezoidal nodal weights normalised to sum to 1 (boundary 1/2, corners 1/4)."""
    h, w = grid
    wr = torch.ones(h, dtype=torch.float64)
    wr[0] = wr[-1] = 0.5
    wc = torch.ones(w, dtype=torch.float64)
    wc[0] = wc[-1] = 0.5
    out = torch.outer(wr / (h - 1), wc / (w - 1))
    return out.to(dtype)


def edge_weights(n: int) -> torch.Tensor:
    """(n,) 1-D trapezoidal weights normalised to sum to 1 (the two end nodes get half)."""
    wv = torch.full((n,), 1.0 / (n - 1), dtype=torch.float64)
    wv[0] = wv[-1] = 0.5 / (n - 1)
    return wv
