"""The generalised Poisson family on the unit cube (3-D DiffNet, problem "poisson3d"): the
``Poisson`` class on a (D, H, W) grid. Its loss, Dirichlet values, KL diffusivity (modes in
``fields``), inputs and reference solver are the 2-D problem's code, written for any number of
axes; this module states the 3-D problem and its defaults.
"""
from __future__ import annotations

from diffnet.problems.families.poisson import Poisson


class Poisson3D(Poisson):
    """-div(nu grad u) = 0 on (z, y, x) in [0, 1]^3, u = 1 on the face x = 0, u = 0 on x = 1,
    zero flux nu du/dn = 0 on the four faces y = 0, 1 and z = 0, 1.

    Grid: ``grid = (D, H, W)`` node counts along (z, y, x), boundary nodes included (the 2-D
    convention (H, W) = (y, x) with the depth axis z in front): a field is (B, 1, D, H, W),
    index [..., k, j, i] is the node (z_k, y_j, x_i), and the Dirichlet faces are the first and
    last x-slices [..., 0] and [..., -1]. D, H, W >= 4 each.

    Diffusivity (``fields``): nu = exp(sum_{i=1..M} omega_i lambda_i cos(k_i pi x)
    cos(l_i pi y) cos(m_i pi z)), lambda_i = 1 / (1 + k_i^2 + l_i^2 + m_i^2), over the modes
    that vary along at least two axes, (0,1,1), (1,0,1), (1,1,0), (1,1,1), (0,1,2), (0,2,1), ...
    (by frequency, then k, then l; the single-axis cosines of the 2-D rule would make nu
    separable and, with 4 terms, the solution a function of x alone); M = ``n_terms`` (default
    4; 4 to 6 are the sizes of interest), omega_i uniform in ``omega_range`` (default (-3, 3)).
    |log nu| <= 3.75 for 4 terms (nu in [0.024, 42.5]), 4.75 for 6 (nu in [0.0087, 116])
    (``nu_range()``). param_names = ("omega_1", ..., "omega_M").

    Input channels ("nu", "log_nu"), each (D, H, W). Given fields: "nu" alone is enough.

    ``impose`` ALWAYS makes the Dirichlet values exact, by ``bc_mode``: "overwrite" (default)
    writes 1 on x = 0 and 0 on x = 1 over the network's output; "lift" returns u = (1 - x) +
    4 x (1 - x) * raw (the network learns the departure from the constant-nu solution).

    Loss (``loss``):
      * "energy" (default): "pde" = integral of nu |grad u|^2 / 2 over the cube, by
        ``quadrature``: "faces" (default; harmonic face nu, trapezoid across and midpoint
        along, ``KLDiffusionProblem.diffusion_features``), whose minimiser is exactly the
        7-point finite-volume reference solution (its gradient at the free nodes is that
        scheme's residual); or "nodes" (nodal gradients by ``FiniteDifference(kind=stencil)``,
        trapezoidal nodal weights; the checkerboard-blind ablation). The zero-flux faces are
        the energy's natural condition: "bc" = 0. Minimum: the effective conductance / 2 (0.5
        for nu = 1, u = 1 - x).
      * "residual" (ablation): "pde" = mean over the interior nodes of (u_xx + u_yy + u_zz +
        grad(log nu) . grad u)^2 = (div(nu grad u) / nu)^2, derivatives of u and log nu by ONE
        ``FiniteDifference(kind=stencil)`` call; "bc" = bc_weight * the mean over the four
        zero-flux faces of the mean of (du/dn)^2 there. ``residual_norm`` as in ``Poisson``:
        "l2" (this mean square), "multilevel", or "operator" (the conservative seven-point
        finite-volume residual in ``operator_norm``; "bc" = 0).

    Domain parallelism: every loss, quadrature and ``bc_mode`` splits exactly on a block of the
    (D, H, W) grid (``on_block``), as the 2-D ``Poisson`` does.
    """

    name = "poisson3d"
    dims = 3                     # grid axes (z, y, x); the 2-D problems have 2

    def __init__(self, *, grid=(32, 32, 32), n_terms: int = 4, omega_range=(-3.0, 3.0),
                 loss: str = "energy", quadrature: str = "faces", stencil: str = "sobel",
                 bc_weight: float = 1.0, bc_mode: str = "overwrite", residual_norm: str = "l2"):
        # the 2-D problem's options; only the default grid differs
        super().__init__(grid=grid, n_terms=n_terms, omega_range=omega_range, loss=loss,
                         quadrature=quadrature, stencil=stencil, bc_weight=bc_weight,
                         bc_mode=bc_mode, residual_norm=residual_norm)
