"""The problems' losses on blocks of a split grid (issue #15), in one process without MPI.

The blocks run in threads of this process, like ranks (``diffnet.problems.check.split``, the
emulation ``deepfusion check-problem`` uses for a user's problem): every block computes on
views of the SAME global autograd leaf, so summing the blocks' terms and backpropagating once
carries the gradient across the blocks exactly as the collectives' adjoint exchange would. The
check: for every problem, loss form / scheme and split, the sum over the blocks of each
per-sample term equals the undivided term, and so does its gradient w.r.t. the global raw
field.
"""
from __future__ import annotations

import pytest
import torch

from diffnet.domain import Block
from diffnet.problems import get_problem
from diffnet.problems.check.split import (ThreadSplit, compare_split, run_blocks, split_run,
                                          terms_and_grads, undivided)
from diffnet.stencils import FiniteDifference, derivative_names, pad_cubic, pad_cubic_block

GRID = (16, 12)            # not square: rows and columns must not be mixed up
GRID3 = (8, 8, 8)
SPLITS = [[1, 2], [2, 1], [2, 2], [4, 2]]
SPLITS3 = [[1, 2, 2], [2, 1, 1], [2, 2, 2]]
RTOL, ATOL = 1e-10, 1e-13


# -- the fixtures: a raw field, the inputs ------------------------------------------------------
def data(p, grid, seed=0, batch=2):
    p.set_progress(0.25)
    x = p.build_input(p.sample_params(seed, range(batch)), dtype=torch.float64)
    g = torch.Generator().manual_seed(seed + 7)
    # an offset with noise of either sign (Burgers' fluxes see both wave directions)
    raw = 0.4 + 0.3 * torch.randn((batch, p.output_channels, *grid), generator=g,
                                  dtype=torch.float64)
    return raw.requires_grad_(), x


def check_split_exact(make, grid, split, exact_impose=True):
    """``exact_impose``: the blocks impose bit for bit as undivided (False: a global reduction
    inside impose, the Ritz solve, sums in another order)."""
    p = make()
    raw, x = data(p, grid)
    u_ref, ref = undivided(p, raw, x)
    u, got = split_run(make, split, raw, x)
    n = len(ThreadSplit(grid, split).coords)
    bad = compare_split(u_ref, ref, u, got, n, exact_impose=exact_impose, rtol=RTOL, atol=ATOL)
    assert bad is None, f"{bad.method} returned {bad.got}; expected {bad.expected}"
    # the check is not vacuous: the terms and their gradients are not all zero
    assert any(v[0].abs().max() > 0 for v in ref.values())
    assert any(v[1].abs().max() > 0 for v in ref.values())


# -- the problems' configurations ---------------------------------------------------------------
BURGERS = [dict(hard_bc=hb, **kw) for hb in (False, True) for kw in (
    dict(), dict(form="advective", stencil="central"), dict(stencil="sobel3103", viscosity=0.02,
                                                            row_weight=1.5),
    dict(scheme="upwind"), dict(scheme="muscl", limiter="mc", row_weight=1.0),
    dict(scheme="muscl", limiter="vanleer"), dict(scheme="muscl", limiter="superbee"),
    dict(scheme="muscl", limiter="minmod"),
    dict(scheme="lax-oleinik"), dict(scheme="lax-oleinik", smoothing=0.1, row_weight=1.0),
    dict(scheme="lax-oleinik", smoothing=0.1, basin_weight=0.5, basin_reach=3))]
ELLIPTIC = ([("poisson", dict(loss=loss, quadrature=q, bc_mode=bm))
             for loss in ("energy", "residual") for q in ("faces", "nodes")
             for bm in ("overwrite", "lift")]
            + [("reaction_diffusion", dict(quadrature=q, bc_mode=bm))
               for q in ("faces", "nodes") for bm in ("overwrite", "lift")]
            + [("darcy", dict(quadrature=q, bc_mode=bm, coefficient=c))
               for q, bm, c in (("faces", "overwrite", "threshold"), ("nodes", "lift", "threshold"),
                                ("faces", "lift", "lognormal"))])
POISSON3D = [dict(loss=loss, quadrature=q, bc_mode=bm) for loss in ("energy", "residual")
             for q in ("faces", "nodes") for bm in ("overwrite", "lift")]


def ids(kw):
    return ",".join(f"{k}={v}" for k, v in kw.items()) or "default"


@pytest.mark.parametrize("split", SPLITS, ids=str)
@pytest.mark.parametrize("kw", BURGERS, ids=ids)
def test_burgers_terms_split_exactly(kw, split):
    check_split_exact(lambda: get_problem("burgers", grid=GRID, **kw), GRID, split)


@pytest.mark.parametrize("split", ([2, 1], [1, 2], [2, 2]), ids=str)
@pytest.mark.parametrize("scheme,horizon", [("upwind", 4), ("muscl", 2), ("muscl", 4)])
def test_burgers_finite_volume_horizons_split_or_are_refused(scheme, horizon, split):
    grid = (32, 24)
    make = lambda: get_problem("burgers", grid=grid, scheme=scheme, horizon=horizon,   # noqa: E731
                               row_weight=0.7)
    width = {"upwind": 2, "muscl": 4}[scheme] * horizon
    blk = ThreadSplit(grid, split).blocks()[0]
    if width > min(blk.shape):
        with pytest.raises(ValueError, match=f"halo of {width} layers"):
            make().on_block(blk)
    else:
        check_split_exact(make, grid, split)


@pytest.mark.parametrize("split", SPLITS, ids=str)
@pytest.mark.parametrize("name,kw", ELLIPTIC, ids=lambda v: v if isinstance(v, str) else ids(v))
def test_elliptic_terms_split_exactly(name, kw, split):
    check_split_exact(lambda: get_problem(name, grid=GRID, **kw), GRID, split)


RITZ = [("darcy", dict(ritz=True, ritz_fields=3, family="fine-scale")),
        ("darcy", dict(ritz=True, quadrature="nodes", bc_mode="lift")),
        ("reaction_diffusion", dict(ritz=True, ritz_fields=2, quadrature="nodes")),
        ("darcy", dict(ritz=True, ritz_fields=2, ritz_partition=3, family="fine-scale")),
        ("reaction_diffusion", dict(ritz=True, ritz_partition=2))]


@pytest.mark.parametrize("split", SPLITS, ids=str)
@pytest.mark.parametrize("name,kw", RITZ, ids=lambda v: v if isinstance(v, str) else ids(v))
def test_ritz_combinations_split_exactly(name, kw, split):
    """The Ritz solve on a split grid: each block's part of the Gram matrix and of l, summed
    over the blocks, give the undivided combination (to rounding) and the same terms."""
    check_split_exact(lambda: get_problem(name, grid=GRID, **kw), GRID, split,
                      exact_impose=False)


@pytest.mark.parametrize("split", ([8, 1], [1, 6], [4, 3]), ids=str)
def test_face_energies_split_into_thin_blocks(split):
    """The "faces" energy needs no stencil: blocks of 2 or 3 nodes split it exactly too."""
    for name in ("poisson", "reaction_diffusion"):
        check_split_exact(lambda: get_problem(name, grid=GRID), GRID, split)


@pytest.mark.parametrize("split", SPLITS3, ids=str)
@pytest.mark.parametrize("kw", POISSON3D, ids=ids)
def test_poisson3d_terms_split_exactly(kw, split):
    check_split_exact(lambda: get_problem("poisson3d", grid=GRID3, **kw), GRID3, split)


def test_burgers_residual_field_on_blocks():
    """pde_residual on a block is the block's part of the undivided residual field."""
    for kw in (dict(), dict(scheme="upwind", horizon=2), dict(scheme="muscl")):
        p = get_problem("burgers", grid=GRID, **kw)
        raw, _ = data(p, GRID)
        ref = p.pde_residual(raw.detach())
        ts = ThreadSplit(GRID, [2, 2])
        blocks, parts = run_blocks(ts, lambda b: get_problem("burgers", grid=GRID, **kw)
                                   .on_block(b).pde_residual(b.local(raw.detach())))
        got = ts.assemble({b.coord: r for b, r in zip(blocks, parts)}, 2)
        torch.testing.assert_close(got, ref, rtol=RTOL, atol=1e-10)


# -- the undivided block is today's code path ----------------------------------------------------
@pytest.mark.parametrize("name,kw", [("burgers", kw) for kw in BURGERS]
                         + ELLIPTIC + [("poisson3d", kw) for kw in POISSON3D],
                         ids=lambda v: v if isinstance(v, str) else ids(v))
def test_the_undivided_block_gives_exactly_the_terms_of_a_problem_without_on_block(name, kw):
    grid = GRID3 if name == "poisson3d" else GRID
    plain = get_problem(name, grid=grid, **kw)
    on = get_problem(name, grid=grid, **kw).on_block(Block(grid))
    assert plain.block.whole and plain.block.grid == plain.grid
    for dtype in (torch.float32, torch.float64):
        raw, x = data(plain, grid)
        raw, x = raw.detach().to(dtype).requires_grad_(), x.to(dtype)
        on.set_progress(0.25)
        ref = terms_and_grads(plain.loss_terms(plain.answer(raw, x), x), raw)
        got = terms_and_grads(on.loss_terms(on.answer(raw, x), x), raw)
        for k in ref:
            assert torch.equal(got[k][0], ref[k][0]) and torch.equal(got[k][1], ref[k][1]), k


# -- on_block refuses what does not split ---------------------------------------------------------
def test_on_block_refuses_a_block_of_another_grid():
    with pytest.raises(ValueError, match="block .* of grid \\[16, 16\\].* on grid \\[16, 12\\]"):
        get_problem("poisson", grid=GRID).on_block(Block((16, 16)))


@pytest.mark.parametrize("name,kw", [("burgers", {}), ("poisson", dict(loss="residual")),
                                     ("darcy", dict(quadrature="nodes"))])
def test_stencils_refuse_boundary_blocks_under_4_nodes(name, kw):
    blk = ThreadSplit(GRID, [1, 6]).blocks()[0]         # 2 columns per block
    with pytest.raises(ValueError, match="at least 4 nodes along axis 1"):
        get_problem(name, grid=GRID, **kw).on_block(blk)


def test_burgers_refuses_a_finite_volume_halo_wider_than_the_blocks():
    blk = ThreadSplit(GRID, [1, 2]).blocks()[0]         # 6 columns per block
    with pytest.raises(ValueError, match="scheme='muscl' with horizon 2.*halo of 8 layers"):
        get_problem("burgers", grid=GRID, scheme="muscl", horizon=2).on_block(blk)
    get_problem("burgers", grid=GRID, scheme="upwind", horizon=2).on_block(blk)   # 4 <= 6


# -- the stencils on blocks ----------------------------------------------------------------------
@pytest.mark.parametrize("split", SPLITS + [[4, 4]], ids=str)
def test_finite_differences_on_blocks_are_the_undivided_ones(split):
    u = torch.randn((2, 1, 16, 16), dtype=torch.float64)
    fd = FiniteDifference((0.1, 0.07), "sobel3103", derivative_names(2))
    ts = ThreadSplit((16, 16), split)
    blocks, parts = run_blocks(ts, lambda b: (pad_cubic_block(b.local(u), b),
                                              fd(b.local(u), b)))
    pad = pad_cubic(u)
    for b, (p, _) in zip(blocks, parts):      # the window of the global padding, bit for bit
        assert torch.equal(p, pad[..., b.start[0]:b.start[0] + b.shape[0] + 2,
                                  b.start[1]:b.start[1] + b.shape[1] + 2]), b
    got = ts.assemble({b.coord: r[1] for b, r in zip(blocks, parts)}, 2)
    torch.testing.assert_close(got, fd(u), rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("split", SPLITS3 + [[1, 1, 2], [2, 2, 1]], ids=str)
def test_finite_differences_3d_on_blocks_are_the_undivided_ones(split):
    u = torch.randn((1, 1, 8, 8, 8), dtype=torch.float64)
    fd = FiniteDifference((0.1, 0.2, 0.15), "sobel", derivative_names(3))
    ts = ThreadSplit((8, 8, 8), split)
    blocks, parts = run_blocks(ts, lambda b: (pad_cubic_block(b.local(u), b),
                                              fd(b.local(u), b)))
    pad = pad_cubic(u)
    for b, (p, _) in zip(blocks, parts):
        window = pad
        for a in range(3):
            window = window.narrow(2 + a, b.start[a], b.shape[a] + 2)
        assert torch.equal(p, window), b
    got = ts.assemble({b.coord: r[1] for b, r in zip(blocks, parts)}, 2)
    torch.testing.assert_close(got, fd(u), rtol=1e-12, atol=1e-9)


def test_finite_differences_check_the_block_field():
    fd = FiniteDifference((0.1, 0.1))
    blk = ThreadSplit((16, 16), [2, 2]).blocks()[0]
    with pytest.raises(ValueError, match="block's part"):
        fd(torch.zeros((1, 1, 16, 16), dtype=torch.float64), blk)
    with pytest.raises(ValueError, match="floating-point"):
        fd(torch.zeros((1, 1, 8, 8), dtype=torch.int64), blk)
