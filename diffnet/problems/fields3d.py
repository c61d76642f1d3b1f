"""The 3-D elliptic pieces: the KL-type log-normal diffusivity on a box and the energy
quadratures of (B, 1, D, H, W) node fields (the 3-D counterparts of ``fields.py``).

Diffusivity, arrays (D, H, W) with axes (z, y, x)::

    nu(z, y, x; omega) = exp( sum_{i=1..M} omega_i * lambda_i * cos(k_i pi x / Lx)
                                                 * cos(l_i pi y / Ly) * cos(m_i pi z / Lz) ),
    lambda_i = 1 / (1 + k_i^2 + l_i^2 + m_i^2).

The modes (k_i, l_i, m_i) (k along x, l along y, m along z) are the integer triples with AT
LEAST TWO non-zero entries, ordered by frequency k^2 + l^2 + m^2, ties broken by k, then l (as
the 2-D modes are by k):

    (0,1,1) (1,0,1) (1,1,0) | (1,1,1) | (0,1,2) (0,2,1) (1,0,2) (1,2,0) (2,0,1) (2,1,0) | ...

so 4 terms are the three two-axis products and the three-axis one; 5 and 6 terms add (0,1,2),
(0,2,1). Why not every triple, as the 2-D rule takes every pair: the first three would be the
single-axis cosines, and with 4 terms log nu = A(x) + B(y, z), i.e. nu = a(x) b(y, z), for which
the solution is u(x) alone (div(a b grad u) = b (a u')' = 0 with zero y- and z-fluxes; exactly
so for the finite-volume scheme too, whose harmonic faces factor the same way): a 1-D family in
a 3-D box (5 and 6 terms of that rule would couple the axes, but only through the weaker
two-axis modes, after three separable ones). The modes kept here couple every pair of axes
from the first three terms on, so for every n_terms >= 4 no axis separates and the solutions
are genuinely 3-D (``tests/test_poisson3d.py`` checks that they vary along z and y).

Each mode is a product of cosines, so it has zero normal derivative on every face (the
zero-flux walls of the Poisson problem) and amplitude <= 1, and

    |log nu| <= max|omega| * sum_i lambda_i,

attained at a corner of the box (all cosines +-1 there). With omega in [-3, 3]: M = 4 terms give
sum lambda = 3/3 + 1/4 = 1.25, |log nu| <= 3.75, nu in [0.024, 42.5]; M = 5: 1.417, 4.25,
nu in [0.014, 70.1]; M = 6: 1.583, 4.75, nu in [0.0087, 116] (``log_nu_bound_3d``), close
to the 2-D family's range (4.6 with 4 terms). Typical draws are milder: over 200 draws at 17^3
the median max/min of nu is 30 (90th percentile 86) with 4 terms, 37 (96) with 6.

Energy quadrature of integral nu |grad u|^2 / 2 over the box, divided by its volume:

* ``face_energy_3d`` ("faces"): every difference (u[a+1] - u[a]) / h_a along an axis lives on
  the edge between two nodes and gets the harmonic face diffusivity and the trapezoidal weights
  of the two transverse axes (half on faces, a quarter on edges of the box) times the midpoint
  weight h_a along. Its minimiser is exactly the 7-point vertex-centred finite-volume solution of
  ``diffnet.reference.solve_diffusion_3d`` (the same conductances: gradient = A u - b).
* ``fields.nodal_weights`` ("nodes"): trapezoidal nodal weights for nodal gradients (the ablation;
  blind to the checkerboard mode like its 2-D counterpart).
"""
from __future__ import annotations

import torch

from .blocks import cut, edges
from .fields import harmonic_mean, kl_modes, log_nu_bound


def kl_modes_3d(n_terms: int) -> list[tuple[int, int, int]]:
    """``fields.kl_modes`` of a 3-D grid: triples (k, l, m) (along x, y, z) with at least two
    non-zero entries, by k^2 + l^2 + m^2, then k, then l (the module docstring says why)."""
    return kl_modes(n_terms, 3)


def log_nu_bound_3d(n_terms: int, omega_range) -> float:
    """max |log nu| over the family (attained at a corner of the box)."""
    return log_nu_bound(n_terms, omega_range, 3)


def face_energy_3d(u: torch.Tensor, nu: torch.Tensor, spacing, weights: list[torch.Tensor],
                   block) -> torch.Tensor:
    """(B,) "faces" quadrature of integral nu |grad u|^2 / 2 over the box / its volume; on a
    split ``block``, its part (``blocks.edges``: each edge on the block holding its first node;
    the transverse weights cut to the block). u, nu: (B, 1, D, H, W) (the block's parts);
    spacing (h_z, h_y, h_x); weights: ``fields.axis_weights``. Pure slicing, no convolution."""
    total = 0.0
    for axis, ((u0, n0), (u1, n1)) in enumerate(edges(block, (u, nu))):
        e = harmonic_mean(n1, n0) * ((u1 - u0) / spacing[axis]).square()
        # trapezoid across (the two other axes' weights) x midpoint along (1 / (n - 1) each)
        for other in range(3):
            if other != axis:
                e = e * cut(block, weights[other])
        total = total + e.sum(dim=(1, 2, 3, 4)) / (block.grid[axis] - 1)
    return 0.5 * total
