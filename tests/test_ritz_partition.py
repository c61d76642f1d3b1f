"""The partition-of-unity Ritz answer (``ritz_partition``): the hats, the cell-by-cell Gram
matrix against the dense Galerkin solve over every product u_i phi_a (float64), exact
recovery of a solution whose amplitude is bilinear on the coarse grid, never a higher energy
than the plain combination, and the refusals. The split-grid case is in
test_problems_on_blocks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from diffnet.problems import get_problem
from diffnet.problems.contract.ritz import (Partition, partition_combination, ritz_combination,
                                   self_products, solve_gram)

GRID = (19, 23)            # not square, and (n - 1) / m not an integer for m = 3


def fine(grid=GRID, **kw):
    return get_problem("darcy", grid=grid, family="fine-scale", output_scale=0.01, ritz=True,
                       **kw)


def products(p, u):
    """(B, K J, H, W) every u_i phi_a, field-major, as dense fields."""
    part = Partition(p.grid, p.partition)
    hy, hx = part.hats
    phi = (hy[:, None, :, None] * hx[None, :, None, :]).reshape(-1, *p.grid).to(u)
    return (u[:, :, None] * phi[None, None]).flatten(1, 2)


@pytest.mark.parametrize("m", [1, 3, 5])
def test_the_hats_are_a_partition_of_unity_with_four_per_cell(m):
    part = Partition(GRID, m)
    hy, hx = part.hats
    assert hy.shape == (m + 1, GRID[0]) and hx.shape == (m + 1, GRID[1])
    for h, lines in zip(part.hats, part.lines):
        torch.testing.assert_close(h.sum(0), torch.ones(h.shape[1], dtype=h.dtype))
        assert torch.equal(h[:, lines], torch.eye(m + 1, dtype=h.dtype))
    phi = (hy[:, None, :, None] * hx[None, :, None, :]).reshape(-1, *GRID)
    for rng, hats in part.cells():
        (y0, y1), (x0, x1) = ((lo, n if hi is None else hi + 1) for (lo, hi), n
                              in zip(rng, GRID))          # the closed cell
        live = set(np.flatnonzero(phi[:, y0:y1, x0:x1].abs().sum((1, 2)).numpy()))
        assert live <= set(hats) and len(set(hats)) == 4
    class Whole:
        start, shape = (0, 0), GRID
    torch.testing.assert_close(part.colours(Whole, hy).sum(0),
                               torch.ones(GRID, dtype=torch.float64))


@pytest.mark.parametrize("m", [1, 3])
def test_the_cell_by_cell_gram_is_the_dense_galerkin_solve(m):
    """The answer equals ritz_combination over all K (m + 1)^2 products as dense fields."""
    p = fine(ritz_fields=2, ritz_partition=m)
    x = p.build_input(p.sample_params(3, [0, 1]), dtype=torch.float64)
    raw = torch.randn((2, 2, *GRID), generator=torch.Generator().manual_seed(1),
                      dtype=torch.float64)
    got = p.answer(raw, x)
    u = raw * p._interior(raw)
    nu = x[:, :1]
    want = ritz_combination(products(p, u), lambda v: p.quadratic_features(v, nu),
                            lambda v: p.integrate(v * p.source), lambda t: t)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12 * float(want.abs().max()))


@pytest.mark.parametrize("name", ["darcy", "reaction_diffusion"])
@pytest.mark.parametrize("m", [1, 3, 5])
def test_the_windowed_assembly_is_the_whole_grid_one(name, m):
    """G from each cell's own window (``window_features``, the undivided grid's path) equals G
    from features of the whole coloured grid cut per cell (the split grid's path), with the
    reaction's nodal pair too (reaction_diffusion, kappa = 5)."""
    kw = {"family": "fine-scale"} if name == "darcy" else {}
    p = get_problem(name, grid=GRID, ritz=True, ritz_fields=3, ritz_partition=m, **kw)
    x = p.build_input(p.sample_params(6, [0, 1]), dtype=torch.float64)
    u = torch.randn((2, 3, *GRID), generator=torch.Generator().manual_seed(5),
                    dtype=torch.float64)
    nu = x[:, :1]
    load = p.source * p._weights(u)[2]
    args = (u, lambda v: p.quadratic_features(v, nu), load, p.block.sum, p.head.partition_of(p.grid), p.block)
    window = lambda v, start, stop: p.quadratic_features_window(v, nu, start, stop)
    whole = partition_combination(*args)
    torch.testing.assert_close(partition_combination(*args, window_features=window), whole,
                               rtol=1e-12, atol=1e-14 * float(whole.abs().max()))
    torch.testing.assert_close(p.answer(u, x), partition_combination(
        u * p._interior(u), *args[1:], window_features=window), rtol=0, atol=0)


def test_a_bilinear_amplitude_error_is_corrected_exactly():
    """A field equal to the solution divided by a positive bilinear function of the coarse
    grid has the solution in its partition span: the answer is the reference (to the 1e-7
    shift of G), where the plain Ritz scaling is not."""
    p = fine(ritz_partition=3)
    params = p.sample_params(4, [0, 1])
    x = p.build_input(params, dtype=torch.float64)
    ref = torch.tensor(np.stack([p.reference_solution(q) for q in params]))[:, None]
    hy, hx = Partition(GRID, 3).hats
    amp = torch.einsum("yx,yh,xw->hw", 1 + torch.rand((4, 4), dtype=torch.float64,
                       generator=torch.Generator().manual_seed(2)), hy, hx)
    raw = ref / amp / p.output_scale
    rel = lambda u: float((u - ref).norm() / ref.norm())
    assert rel(p.answer(raw, x)) < 1e-5
    assert rel(fine().answer(raw, x)) > 1e-2


@pytest.mark.parametrize("name", ["darcy", "reaction_diffusion"])
def test_the_energy_is_never_above_the_plain_combination(name):
    kw = {"family": "fine-scale"} if name == "darcy" else {}
    grid = (33, 33)
    plain = get_problem(name, grid=grid, ritz=True, ritz_fields=3, **kw)
    part = get_problem(name, grid=grid, ritz=True, ritz_fields=3, ritz_partition=4, **kw)
    x = plain.build_input(plain.sample_params(5, [0, 1, 2]), dtype=torch.float64)
    raw = torch.randn((3, 3, *grid), generator=torch.Generator().manual_seed(3),
                      dtype=torch.float64).cumsum(-1).cumsum(-2)
    e0 = plain.loss_terms(plain.answer(raw, x), x)["pde"]
    e1 = part.loss_terms(part.answer(raw, x), x)["pde"]
    assert torch.all(e1 <= e0 + 1e-12 * e0.abs()) and torch.any(e1 < e0 - 1e-3 * e0.abs())


def test_gradients_through_the_partition_solve_are_exact():
    """Training differentiates through G, b and the solve: gradcheck on a small grid."""
    p = fine(grid=(7, 9), ritz_fields=2, ritz_partition=2)
    x = p.build_input(p.sample_params(3, [0]), dtype=torch.float64)
    raw = torch.randn((1, 2, 7, 9), dtype=torch.float64, requires_grad=True,
                      generator=torch.Generator().manual_seed(4))
    assert torch.autograd.gradcheck(lambda r: p.loss_terms(p.answer(r, x), x)["pde"], (raw,))


@pytest.mark.parametrize("kw,match", [
    (dict(ritz=False, ritz_partition=2), "ritz_partition = 2 .* needs ritz = true"),
    (dict(ritz=True, quadrature="nodes", ritz_partition=2), "needs the two-point 'faces'"),
    (dict(ritz=True, ritz_partition=16), "ritz_partition"),
    (dict(ritz=True, ritz_partition=-1), "ritz_partition"),
])
def test_bad_partitions_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        get_problem("darcy", grid=(16, 16), **kw)


def test_the_gram_solve_is_right_for_large_batched_systems_on_two_threads():
    """A batch of 1296 x 1296 systems (m = 8, K = 16) on two threads: torch's batched LU
    solve fails there (MKL pivots), the Cholesky solve does not."""
    n, threads = 1296, torch.get_num_threads()
    a = torch.randn((3, n, n), dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    g = a @ a.transpose(1, 2) / n + torch.eye(n, dtype=torch.float64)
    rhs = torch.randn((3, n), dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    try:
        torch.set_num_threads(2)
        c = solve_gram(g, rhs)
    finally:
        torch.set_num_threads(threads)
    res = torch.einsum("bij,bj->bi", g, c) - rhs          # G is shifted by 1e-7 of its diagonal
    assert float(res.abs().max()) < 1e-5 * float(rhs.abs().max())


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("b, n", [(1, 101), (2, 101), (1, 2), (1, 96)])
def test_self_products_split_over_threads_are_the_product(threads, b, n):
    """c c^T whether or not n is cut into one part per thread (a remainder, fewer entries
    than threads, a sample per thread), against the float64 product itself."""
    c = torch.randn((b, 5, n), dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        g = self_products(c)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(g, c @ c.transpose(1, 2), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("m", [0, 2])
def test_the_energy_gradient_at_fixed_coefficients_is_the_full_gradient(m):
    """c minimises the energy over the span, so the energy's gradient with c held fixed (the
    default: no backward pass through G and its solve) equals the gradient through the
    solve (differentiate=True), to the 1e-7 shift of G (float64)."""
    p = fine(ritz_fields=3, ritz_partition=m)
    x = p.build_input(p.sample_params(3, [0, 1]), dtype=torch.float64)
    nu = x[:, :1]
    part = Partition(p.grid, m) if m else None
    grads = []
    for differentiate in (False, True):
        raw = torch.randn((2, 3, *GRID), generator=torch.Generator().manual_seed(8),
                          dtype=torch.float64, requires_grad=True)
        u = raw * p._interior(raw)
        feats = lambda v: p.quadratic_features(v, nu)
        if m:
            load = p.source * p._weights(u)[2]
            ans = partition_combination(u, feats, load, lambda t: t, part, p.block,
                                        differentiate=differentiate)
        else:
            ans = ritz_combination(u, feats, lambda v: p.integrate(v * p.source), lambda t: t,
                                   differentiate=differentiate)
        (g,) = torch.autograd.grad(p.loss_terms(ans, x)["pde"].sum(), raw)
        grads.append(g)
    assert float(grads[0].abs().max()) > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5,
                               atol=1e-5 * float(grads[1].abs().max()))
