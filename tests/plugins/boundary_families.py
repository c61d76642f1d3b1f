"""Two plugin families with boundary data, written with the public contract only
(``diffnet.problems``: ``dirichlet``, ``transfinite_lift``, ``neumann``, ``robin``), each with a
reference solver of the same scheme: tests/test_boundary_families.py checks them with
check-problem (split included) and checks that their losses vanish at the reference.

* ``WarmPlate``: -lap u = f on (y, x) in [0, 1] x [0, 2], u = g on every wall, g a drawn
  function of the coordinates, its lift a channel of the inputs;
* ``FluxPlate``: -lap u = f, u = 0 on y = 0, y = 1 and x = 0, and alpha u + du/dn = q on x = 2
  (alpha = 0: Neumann), q a drawn field of y.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as spla
import torch

from diffnet.problems import Axis, Problem, dirichlet, mesh, neumann, robin, transfinite_lift
from diffnet.stencils import FiniteDifference


def laplacian_rows(grid, spacing) -> sp.csr_matrix:
    """(N, N) the 5-point -lap on the whole grid (rows of the interior nodes are used)."""
    ops = []
    for axis, (n, h) in enumerate(zip(grid, spacing)):
        d2 = sp.diags([1.0, -2.0, 1.0], [-1, 0, 1], (n, n)) / h ** 2
        eye = [sp.identity(m) for m in grid]
        eye[axis] = d2
        ops.append(-sp.kron(eye[0], eye[1]))
    return sp.csr_matrix(sum(ops))


class Plate(Problem):
    """The source, the scheme and its sparse twin the two families share."""

    param_names = ("f_1", "d_1", "d_2")

    def __init__(self, *, grid=(16, 16)):
        super().__init__(grid=grid)
        self.fd = FiniteDifference(self.spacing, "central", derivatives=("rr", "cc"))

    @property
    def axes(self):
        return (Axis("y", 0.0, 1.0), Axis("x", 0.0, 2.0))

    def param_bounds(self):
        return np.array([[-1.0, 1.0]] * 3)

    def source(self, params):
        y, x = mesh(self)
        return 1.0 + params[:, :1, None] * np.cos(np.pi * y) * np.cos(np.pi * x / 2)

    def residual(self, u, inputs):
        return -self.fd(u, self.block).sum(1, keepdim=True) - inputs[:, :1]

    def reference_solution(self, params, method="auto"):
        self.check_method(method)
        x = self.build_input(np.atleast_2d(params), torch.float64)[0].numpy()
        rows, rhs = self.system(x)
        return spla.spsolve(sp.csc_matrix(rows), rhs).reshape(self.grid)


class WarmPlate(Plate):
    """-lap u = f on (y, x) in [0, 1] x [0, 2], u = g on the walls, g = d_1 cos(pi x / 2) +
    d_2 x y; u = lift + 0.1 bubble N, the lift the transfinite interpolation of g."""

    name = "warm_plate"
    input_channels = ("f", "lift")

    def build_input(self, params, dtype=torch.float32):
        params = self.check_params(params)
        d1, d2 = params[:, 1, None, None], params[:, 2, None, None]
        lift = transfinite_lift(self, lambda y, x: d1 * np.cos(np.pi * x / 2) + d2 * x * y)
        return torch.tensor(np.stack([self.source(params), lift], 1), dtype=dtype)

    def impose(self, u, inputs):
        return dirichlet(self, u, inputs[:, 1:2], scale=0.1)

    def loss_terms(self, u, inputs):
        r = self.residual(u, inputs)
        return {"pde": self.mean(r.square(), interior=1), "bc": u.new_zeros(u.shape[0])}

    def system(self, x):
        """(rows, rhs): the scheme on the interior nodes, u = g on the walls."""
        inner = np.zeros(self.grid, dtype=bool)
        inner[1:-1, 1:-1] = True
        inner = inner.ravel()
        rows = sp.lil_matrix(laplacian_rows(self.grid, self.spacing))
        for i in np.flatnonzero(~inner):
            rows.rows[i], rows.data[i] = [i], [1.0]
        return rows.tocsr(), np.where(inner, x[0].ravel(), x[1].ravel())


class FluxPlate(Plate):
    """-lap u = f on (y, x) in [0, 1] x [0, 2], u = 0 on y = 0, 1 and x = 0, alpha u + du/dn
    = q on x = 2, q = d_1 + d_2 cos(pi y): the rim of x = 2 is held by the Dirichlet walls."""

    name = "flux_plate"
    input_channels = ("f", "q")
    DIRICHLET = ("y_lo", "y_hi", "x_lo")

    def __init__(self, *, grid=(16, 16), alpha: float = 0.0):
        super().__init__(grid=grid)
        self.alpha = float(alpha)

    def config(self):
        return {**super().config(), "alpha": self.alpha}

    def build_input(self, params, dtype=torch.float32):
        params = self.check_params(params)
        y, _ = mesh(self)
        q = params[:, 1, None, None] + params[:, 2, None, None] * np.cos(np.pi * y)
        return torch.tensor(np.stack([self.source(params), q], 1), dtype=dtype)

    def impose(self, u, inputs):
        return dirichlet(self, u, 0.0, scale=0.1, walls=self.DIRICHLET)

    def loss_terms(self, u, inputs):
        r = self.residual(u, inputs)
        q = inputs[:, 1:2]
        bc = (neumann(self, u, q, walls="x_hi", rim=False) if self.alpha == 0 else
              robin(self, u, self.alpha, 1.0, q, walls="x_hi", rim=False))
        return {"pde": self.mean(r.square(), interior=1), "bc": bc}

    def system(self, x):
        ny, nx = self.grid
        h = self.spacing[1]
        rows = sp.lil_matrix(laplacian_rows(self.grid, self.spacing))
        rhs = x[0].copy()
        index = np.arange(ny * nx).reshape(self.grid)
        for i in range(ny):
            for j in range(nx):
                k = index[i, j]
                if i in (0, ny - 1) or j == 0:                       # u = 0
                    rows.rows[k], rows.data[k], rhs[i, j] = [k], [1.0], 0.0
                elif j == nx - 1:                                    # alpha u + du/dn = q
                    rows.rows[k] = [index[i, j - 2], index[i, j - 1], k]
                    rows.data[k] = [1 / (2 * h), -4 / (2 * h), 3 / (2 * h) + self.alpha]
                    rhs[i, j] = x[1, i, j]
        return rows.tocsr(), rhs.ravel()
