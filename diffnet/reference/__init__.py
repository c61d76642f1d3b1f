"""Classical reference solvers (numpy / scipy / pyamg only; independent of torch and the networks).

* :func:`solve_burgers` -- inviscid Burgers, first-order Godunov finite volumes (entropy solution).
* :func:`solve_burgers_exact` -- inviscid Burgers, the exact entropy solution (Lax-Oleinik);
  :func:`exact_cell_averages` -- its exact averages over the cells of a grid.
* :func:`solve_diffusion` -- -div(nu grad u) + kappa^2 u = f, second-order vertex-centred finite
  volumes, direct (SuperLU) or AMG (pyamg) linear solve.
* :func:`solve_diffusion_3d` -- the same on a 3-D box (7-point vertex-centred finite volumes).
* :func:`diffusion_system`, :func:`diffusion_system_3d` -- one sample's assembled system
  (:class:`ReferenceSystem`), refined by AMG-preconditioned CG from a given initial guess.
"""
from .burgers import godunov_flux, riemann_state, solve_burgers
from .burgers_exact import exact_cell_averages, solve_burgers_exact
from .elliptic import (DIRECT_MAX_UNKNOWNS, ReferenceSystem, assemble_diffusion,
                       diffusion_system, solve_diffusion)
from .elliptic3d import (DIRECT_MAX_UNKNOWNS_3D, assemble_diffusion_3d, diffusion_system_3d,
                         solve_diffusion_3d)

__all__ = [
    "solve_burgers", "solve_burgers_exact", "exact_cell_averages", "godunov_flux", "riemann_state",
    "solve_diffusion", "assemble_diffusion", "DIRECT_MAX_UNKNOWNS",
    "solve_diffusion_3d", "assemble_diffusion_3d", "DIRECT_MAX_UNKNOWNS_3D",
    "ReferenceSystem", "diffusion_system", "diffusion_system_3d",
]
