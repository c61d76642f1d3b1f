"""The built-in Poisson trained on the gradient of its own discrete energy (as
``poisson_gradient_residual``), measured by the operator-preconditioned norm ``operator_norm``
(a V-cycle of the energy's own Hessian) instead of the Laplacian's BPX norm: does a norm
equivalent to the energy for any coefficient train as well as the energy (issue #68, round 3)?

The loss is the built-in's ``loss = "residual"``, ``residual_norm = "operator"``
(``diffnet.problems.families.poisson``; its residual in closed form,
``diffnet.problems.families.faces_residual``): this plugin only forces those two options, so
the round-3 command keeps working on a recipe that says ``loss = "energy"``:

    deepfusion train configs/recipes/poisson.toml \\
        --set 'problem.name="lab.plugins.poisson_operator_residual:PoissonOperatorResidual"'

which is the same training as

    deepfusion train configs/recipes/poisson.toml \\
        --set 'problem.options.loss="residual"' --set 'problem.options.residual_norm="operator"'

r = dE/du / h^2 at every node (the five-point finite-volume -div(nu grad u), half cells on the
walls), the Dirichlet columns x = 0, 1 not unknowns; "pde" = operator_norm / 2: about the
energy error e^T A e / 2. The round-3 runs of lab/notes/residual_norm.md computed r by autograd
through E (a double backward, whole grid only); the built-in's closed form agrees with it to
rounding and splits exactly.
"""
from __future__ import annotations

from diffnet.problems import Poisson


class PoissonOperatorResidual(Poisson):
    """Poisson (the built-in) with ``loss = "residual"``, ``residual_norm = "operator"``."""

    name = "poisson_operator_residual"

    def __init__(self, **options):
        super().__init__(**{**options, "loss": "residual", "residual_norm": "operator"})
