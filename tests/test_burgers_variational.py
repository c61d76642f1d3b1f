"""The Lax-Oleinik (variational) Burgers loss: its per-node minimiser is the exact entropy
solution, its gradient is the characteristic equation, and its smoothing follows the schedule."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from diffnet.problems import get_problem
from diffnet.problems.families.burgers import initial_condition
from diffnet.problems.families.lax_oleinik import basin_targets, lax_oleinik_nodes

C = 4.3


def _setup(grid=(64, 64), **kw):
    p = get_problem("burgers", grid=grid, scheme="lax-oleinik", hard_bc=True, **kw)
    x = p.build_input(np.array([[C]]), dtype=torch.float64)
    exact = torch.tensor(p.reference_solution(np.array([C])))[None, None]
    return p, x, exact


def _g(p, u, x):
    """The per-node functional g(u) on rows t > 0, as the loss computes it."""
    v, geometry = p._lo_nodes(u, x)
    return lax_oleinik_nodes(v, *geometry, [(0.0, 1.0)])


def test_exact_solution_is_the_per_node_minimiser():
    p, x, exact = _setup()
    g_exact = _g(p, exact, x)
    assert np.abs(np.diff(exact[0, 0, -1].numpy())).max() > 0.3      # shocks have formed
    for delta in (-0.3, -0.05, -0.01, 0.01, 0.05, 0.3):
        g = _g(p, exact + delta, x)
        assert bool((g >= g_exact - 1e-7).all()), delta             # no node does better
        assert float((g - g_exact).mean()) > 0.1 * delta**2         # and most do worse
    # moving each shock by one node (the other branch) costs: the Godunov reference, whose
    # shocks are smeared over nodes, has a larger loss than the exact solution
    god = get_problem("burgers", grid=(64, 64), reference="godunov")
    smeared = torch.tensor(god.reference_solution(np.array([C])))[None, None]
    assert float(p.loss_terms(smeared, x)["pde"]) > float(p.loss_terms(exact, x)["pde"])


def test_gradient_is_the_characteristic_equation():
    p, x, exact = _setup()
    torch.manual_seed(0)
    u = (exact + 0.1 * torch.rand_like(exact)).requires_grad_()
    (grad,) = torch.autograd.grad(_g(p, u, x).sum(), u)
    t = torch.tensor(p.coords()["t"])[1:, None]
    xs = torch.tensor(p.coords()["x"])
    v = u.detach()[0, 0, 1:]
    want = v - torch.tensor(initial_condition(C, (xs - v * t).clamp_min(0).numpy()))
    torch.testing.assert_close(grad[0, 0, 1:], want, rtol=0, atol=2e-3)
    assert float(grad[0, 0, 0].abs().max()) == 0.0                   # row 0 carries no term


def test_smoothing_schedule_and_final_loss():
    p, x, exact = _setup(smoothing=0.2, smoothing_until=0.5)
    plain, _, _ = _setup()
    assert p.current_smoothing() == pytest.approx(0.2)
    p.set_progress(0.25)
    assert p.current_smoothing() == pytest.approx(0.1)
    smoothed = float(p.loss_terms(exact, x)["pde"])
    # Gaussian averaging adds sigma^2 / 2 * g'' > 0 around a minimum
    assert smoothed > float(plain.loss_terms(exact, x)["pde"]) + 1e-4
    for f in (0.5, 0.9):
        p.set_progress(f)
        assert p.current_smoothing() == 0.0
        torch.testing.assert_close(p.loss_terms(exact, x)["pde"], plain.loss_terms(exact, x)["pde"])


def test_no_residual_and_default_reference_is_exact():
    p, x, exact = _setup(grid=(16, 16))
    with pytest.raises(ValueError, match="no residual"):
        p.pde_residual(exact)
    god = get_problem("burgers", grid=(16, 16), reference="godunov")
    assert not np.allclose(god.reference_solution(np.array([C])), exact[0, 0].numpy())


@pytest.mark.parametrize("sigma", [0.0, 0.15])
def test_closed_form_gradient_is_autograds(sigma):
    """The loss's custom backward (the characteristic equation, computed beside the value) gives
    autograd's value and gradient through the cubic Hermite primitive, in float64, including
    feet x - u t left of the inflow and right of the outflow boundary."""
    from diffnet.primitive import node_primitive
    from diffnet.problems.families.lax_oleinik import lax_oleinik_nodes

    torch.manual_seed(1)
    b, h, w, dx = 2, 6, 33, 1 / 32
    u0 = torch.rand(b, w, dtype=torch.float64)
    big = node_primitive(u0, dx)
    x = torch.arange(w, dtype=torch.float64) * dx
    t = torch.linspace(0.05, 1.0, h, dtype=torch.float64)[:, None]
    here = big[:, None, :]
    v = (3 * torch.rand(b, h, w, dtype=torch.float64) - 1.5).requires_grad_()  # feet on both sides
    points = [(0.0, 1.0)] if sigma == 0 else [(-sigma, 0.25), (0.0, 0.5), (sigma, 0.25)]
    got = lax_oleinik_nodes(v, big, u0, x, t, here, dx, points)
    (g_got,) = torch.autograd.grad((got * torch.cos(v.detach())).sum(), v)
    from diffnet.problems.families.lax_oleinik import lax_oleinik_value

    # the functional through primitive_at, differentiated by autograd
    want = sum(w * lax_oleinik_value(v + s, big, u0, x, t, here, dx) for s, w in points)
    (g_want,) = torch.autograd.grad((want * torch.cos(v.detach())).sum(), v)
    feet = (x - v.detach() * t)
    assert bool((feet < 0).any()) and bool((feet > 1).any())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    torch.testing.assert_close(g_got, g_want, rtol=0, atol=1e-12)
    with pytest.raises(RuntimeError, match="initial condition"):
        lax_oleinik_nodes(v, big.clone().requires_grad_(), u0, x, t, here, dx, points)


def test_basin_targets_put_moved_shocks_back():
    """The exact solution is its own target everywhere; with every shock moved one node right,
    the targets (the best of each node's and its neighbours' values) restore it."""
    p, x, exact = _setup(basin_weight=0.1)
    assert float(p._basin(*p._lo_nodes(exact, x)).max()) < 1e-9
    moved = exact.clone()
    right = exact[..., :-1] - exact[..., 1:] > 0.5                   # downward jumps: the shocks
    moved[..., 1:][right] = exact[..., :-1][right]
    assert int(right.sum()) > 20
    v, geometry = p._lo_nodes(moved, x)
    g = lambda c: lax_oleinik_nodes(c, *geometry, [(0.0, 1.0)])
    target = basin_targets(v, g, 2)
    # rows t >= T/2 (shocks formed; earlier, steep fronts hold values between the neighbours'
    # two states): every moved node is back in its basin, off by at most the neighbour's slope
    at = torch.zeros_like(exact, dtype=torch.bool)
    at[..., 1:-1] = right[..., :-1]       # the last column has no neighbour across the shock
    at = at[0, 0, 32:]                                  # target row k is the field's row k + 1
    assert float((v[0, 31:] - exact[0, 0, 32:])[at].abs().min()) > 0.5
    assert float((target[0, 31:] - exact[0, 0, 32:])[at].abs().max()) < 0.1
    assert bool((g(target) <= g(v)).all())                          # never a worse node
    assert float(p._basin(*p._lo_nodes(moved, x))) > 1e-3


def test_basin_term_pulls_a_node_out_of_the_wrong_basin():
    """A node in the wrong basin is a stationary point of g (no gradient); the basin term's
    gradient points it towards its neighbour's value across the shock."""
    p, x, exact = _setup(basin_weight=1.0)
    right = exact[..., :-1] - exact[..., 1:] > 0.5
    i, j = [int(k) for k in right[0, 0].nonzero()[-1]]
    moved = exact.clone()
    moved[0, 0, i, j + 1] = exact[0, 0, i, j]                        # the shock a node right
    u = moved.requires_grad_()
    (g_grad,) = torch.autograd.grad(_g(p, u, x).sum(), u)
    (b_grad,) = torch.autograd.grad(p._basin(*p._lo_nodes(u, x)).sum(), u)
    needed = float(exact[0, 0, i, j + 1] - moved[0, 0, i, j + 1].detach())  # across the shock
    assert -float(g_grad[0, 0, i, j + 1]) * needed <= 0              # g keeps it in its basin
    assert -float(b_grad[0, 0, i, j + 1]) * needed > 0               # the basin term does not


def test_basin_option_is_checked():
    with pytest.raises(ValueError, match="basin_weight > 0 needs scheme='lax-oleinik'"):
        get_problem("burgers", grid=(16, 16), scheme="muscl", basin_weight=0.1)
    with pytest.raises(ValueError, match="basin_reach"):
        get_problem("burgers", grid=(16, 16), scheme="lax-oleinik", basin_reach=0)
    p = get_problem("burgers", grid=(16, 16), scheme="lax-oleinik", basin_weight=0.1)
    assert p.config()["basin_weight"] == 0.1
