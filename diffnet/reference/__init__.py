"""Classical reference solvers (numpy / scipy / pyamg only; independent of torch and the networks).

* :func:`solve_burgers` -- inviscid Burgers, first-order Godunov finite volumes (entropy solution).
* :func:`solve_burgers_exact` -- inviscid Burgers, the exact entropy solution (Lax-Oleinik);
  :func:`exact_cell_averages` -- its exact averages over the cells of a grid.
* :func:`solve_diffusion` -- -div(nu grad u) + kappa^2 u = f on a 2-D or 3-D node grid,
  second-order vertex-centred finite volumes, direct (SuperLU) or AMG (pyamg) linear solve.
* :func:`diffusion_system` -- one sample's assembled system (:class:`ReferenceSystem`), refined
  by AMG-preconditioned CG from a given initial guess.
"""
from diffnet.reference.burgers import solve_burgers
from diffnet.reference.burgers_exact import exact_cell_averages, solve_burgers_exact
from diffnet.reference.elliptic import (DIRECT_MAX_UNKNOWNS, ReferenceSystem, assemble_diffusion,
                       diffusion_system, solve_diffusion)

__all__ = [
    "solve_burgers", "solve_burgers_exact", "exact_cell_averages",
    "solve_diffusion", "assemble_diffusion", "DIRECT_MAX_UNKNOWNS",
    "ReferenceSystem", "diffusion_system",
]
