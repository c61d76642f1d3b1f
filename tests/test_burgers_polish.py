"""Polishing a Burgers answer with the Lax-Oleinik functional (``polish = N``): per-node
safeguarded Newton steps from a given field (diffnet.problems.lax_oleinik), float64."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from diffnet.primitive import node_primitive, primitive_at, primitive_derivatives_at
from diffnet.problems import get_problem

C = 4.3


def _problem(polish, grid=(64, 64)):
    return get_problem("burgers", grid=grid, scheme="lax-oleinik", hard_bc=True, polish=polish)


def _fields(grid=(64, 64)):
    p = _problem(0, grid)
    x = p.build_input(np.array([[C], [5.7]]), dtype=torch.float64)
    exact = torch.tensor(np.stack([p.reference_solution(np.array([c])) for c in (C, 5.7)]))
    return x, exact[:, None]


def _smeared(u):
    """Every row averaged over 3 neighbouring nodes along x: shocks 3 nodes wide."""
    v = u.clone()
    v[..., 1:-1] = (u[..., :-2] + u[..., 1:-1] + u[..., 2:]) / 3
    return v


def _rel(u, ref):
    return float((u - ref).norm() / ref.norm())


def test_closed_form_derivatives_are_the_interpolants():
    """primitive_derivatives_at: the value of primitive_at, and its first and second
    derivatives in y as autograd gives them, inside and outside the nodes."""
    h = 1 / 63
    f = (0.5 * (1 - torch.cos(2 * torch.pi * 4 * torch.linspace(0, 1, 64, dtype=torch.float64))))
    f = f[None].repeat(2, 1)
    F = node_primitive(f, h)
    y = (torch.rand(2, 300, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
         * 1.2 - 0.1).requires_grad_()
    v = primitive_at(F, f, h, y)
    (d1,) = torch.autograd.grad(v.sum(), y, create_graph=True)
    (d2,) = torch.autograd.grad(d1.sum(), y)
    got = primitive_derivatives_at(F, f, h, y.detach())
    for a, b in zip(got, (v, d1, d2)):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=1e-10)


def test_polish_sharpens_smeared_shocks_and_never_raises_the_loss():
    x, exact = _fields()
    start = _problem(0).impose(_smeared(exact), x)
    out = _problem(10).impose(start, x)
    assert _rel(start, exact) > 0.04                      # 3-node shocks: several percent off
    assert _rel(out, exact) < 0.1 * _rel(start, exact)    # back to the shocks' nodes
    g = _problem(0)._lax_oleinik
    assert bool((g(out, x) <= g(start, x) + 1e-12).all())  # no node's functional went up
    torch.testing.assert_close(out[:, :, 0], x[:, :1, 0])   # the initial row stays u0
    assert float(out[..., 0].abs().max()) == 0.0            # and the inflow column 0


def test_the_exact_solution_is_kept():
    """The exact entropy solution is (to the primitive's interpolation error) the functional's
    minimiser at every node: polishing it moves nothing that matters."""
    x, exact = _fields()
    out = _problem(5).impose(exact, x)
    assert _rel(out, exact) < 2e-3


def test_a_node_in_the_wrong_basin_stays_there():
    """It is not a solver: a shock the start puts one node off stays one node off."""
    x, exact = _fields()
    shifted = exact.clone()
    shifted[..., 1:, 2:] = exact[..., 1:, 1:-1]           # every row moved one node right
    start = _problem(0).impose(shifted, x)
    out = _problem(10).impose(start, x)
    assert _rel(out, exact) > 0.5 * _rel(start, exact)


def test_training_refuses_polish():
    p = _problem(3)
    with pytest.raises(ValueError, match="polish = 3 is for answering"):
        p.check_training()
    _problem(0).check_training()
    with pytest.raises(ValueError, match="polish"):
        get_problem("burgers", grid=(64, 64), polish=-1)


def test_primitive_on_a_scattered_subset_of_rows():
    """primitive_at(..., rows=r) evaluates point p on row r[p]: the full evaluation's values."""
    g = torch.Generator().manual_seed(1)
    F, f = torch.rand(3, 20, dtype=torch.float64, generator=g), torch.rand(3, 20, dtype=torch.float64, generator=g)
    y = torch.rand(3, 7, dtype=torch.float64, generator=g) * 1.4 - 0.2
    full = primitive_at(F, f, 0.05, y, left=0.3)
    rows, cols = torch.tensor([2, 0, 0, 1]), torch.tensor([6, 0, 3, 5])
    got = primitive_at(F, f, 0.05, y[rows, cols], left=0.3, rows=rows)
    torch.testing.assert_close(got, full[rows, cols], rtol=0, atol=0)
