"""The multilevel residual norm (``diffnet.problems.residual_norm``): exact on a split grid
(blocks in threads of this process; a real ``mpiexec -n 2`` case), a norm (non-negative, zero
only for a zero residual, quadratic in scale), its options refused with the fix, and the claim
it is for: u -> ||A u||_B^2 of the discrete Laplacian A is conditioned like the energy
u^T A u, while the squared residual ||A u||^2 is conditioned like its square."""
from __future__ import annotations

import doctest
import importlib
import math

import numpy as np

import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla
import torch

from diffnet.domain import Block
from diffnet.problems import get_problem, residual_norm
from diffnet.problems.check.split import (ThreadSplit, close, run_blocks, split_run,
                                          terms_and_grads, undivided)
from diffnet.problems.contract.residual_norm import max_levels
from tests.mpi_util import run_script_cases

# (grid, split): aligned cells, cells straddling blocks (a block side not a multiple of the
# cell), ragged cells (a grid not a multiple of the cell), 1-D to 3-D
CASES = [((16, 16), (1, 2)), ((16, 16), (2, 2)), ((16, 24), (2, 2)), ((18, 18), (2, 2)),
         ((8, 8, 8), (2, 2, 2)), ((12, 8, 8), (2, 2, 2)), ((24,), (2,)), ((20,), (4,))]


def spacing_of(grid):
    return tuple(1.0 / (n - 1) for n in grid)


def norms(block, r, **kw):
    """Two norms of r on this block: the default, and one with options."""
    h = spacing_of(block.grid)
    return {"default": residual_norm(r, block, spacing=h),
            "options": residual_norm(r, block, spacing=h, levels=2, weights=(0.5, 2.0),
                                     interior=(0,) + (1,) * (block.dims - 1)),
            "coefficient": residual_norm(r, block, spacing=h, coefficient=_tilt(block, r),
                                         reaction=torch.tensor([0.0, 10.0, 1e3]),
                                         advection=torch.tensor([3.0, 0.0, 30.0]))}


def _tilt(block, r):
    """A positive coefficient varying along the first axis, by global node index."""
    return 1.0 + block.indices(0, r).to(r.dtype).view((-1,) + (1,) * (block.dims - 1))


@pytest.mark.parametrize("grid,split", CASES, ids=str)
def test_split_value_and_gradient_are_the_undivided_ones(grid, split):
    g = torch.Generator().manual_seed(sum(grid) + sum(split))
    r = torch.randn((3, 1, *grid), generator=g, dtype=torch.float64, requires_grad=True)
    ref = terms_and_grads(norms(Block(grid), r), r)
    _, parts = run_blocks(ThreadSplit(grid, split), lambda b: norms(b, b.local(r)))
    got = terms_and_grads({k: sum(p[k] for p in parts) for k in parts[0]}, r)
    for k in ref:
        assert close(got[k][0], ref[k][0], rtol=1e-12), (k, got[k][0], ref[k][0])
        assert close(got[k][1], ref[k][1], rtol=1e-12), k
        assert ref[k][1].abs().max() > 0, k


@pytest.mark.parametrize("split", [(1, 2), (2, 2)])
def test_poisson_multilevel_residual_splits(split):
    make = lambda: get_problem("poisson", grid=(16, 16), loss="residual",    # noqa: E731
                               residual_norm="multilevel")
    p = make()
    x = p.build_input(p.sample_params(0, range(2)), dtype=torch.float64)
    raw = (0.4 + 0.3 * torch.randn((2, 1, 16, 16), generator=torch.Generator().manual_seed(3),
                                   dtype=torch.float64)).requires_grad_()
    ref_u, ref = undivided(p, raw, x)
    got_u, got = split_run(make, split, raw, x)
    assert torch.equal(got_u, ref_u)
    for k in ref:
        assert close(got[k][0], ref[k][0]) and close(got[k][1], ref[k][1]), k


@pytest.mark.mpi
def test_real_mpi_two_ranks():
    run_script_cases(2, "tests/mpi_scripts/residual_norm_check.py", ["16x16:1x2", "16x24:1x2"])


def test_a_norm_quadratic_in_scale_and_zero_only_at_zero():
    grid, h = (20, 16), spacing_of((20, 16))
    g = torch.Generator().manual_seed(0)
    r = torch.randn((64, *grid), generator=g, dtype=torch.float64)
    r[:8] = 0
    r[8:16] *= 1e-9
    n2 = residual_norm(r, Block(grid), spacing=h)
    assert (n2[:8] == 0).all() and (n2[8:] > 0).all()
    for c in (-3.0, 0.5, 1e3):
        assert torch.allclose(residual_norm(c * r, Block(grid), spacing=h), c * c * n2,
                              rtol=1e-13, atol=0)
    # a single node's residual anywhere inside is seen: zero only for r = 0
    one = torch.zeros((1, *grid), dtype=torch.float64)
    for i, j in [(1, 1), (18, 14), (7, 3)]:
        one.zero_()
        one[0, i, j] = 1
        assert residual_norm(one, Block(grid), spacing=h).item() > 0
    # the nodes the interior leaves out do not count, at any level
    one.zero_()
    one[0, 0, 5] = one[0, 19, 0] = 1
    assert residual_norm(one, Block(grid), spacing=h).item() == 0


def test_problem_form_and_refusals_say_the_fix():
    p = get_problem("poisson", grid=(16, 16))
    r = torch.randn(2, 16, 16, dtype=torch.float64)
    assert torch.equal(residual_norm(r, p), residual_norm(r, Block((16, 16)), spacing=p.spacing))
    assert max_levels((16, 16)) == 4 and max_levels((64, 64)) == 6 and max_levels((5,)) == 2
    with pytest.raises(ValueError, match="needs spacing="):
        residual_norm(r, Block((16, 16)))
    with pytest.raises(ValueError, match=r"levels must be an integer in 1..4"):
        residual_norm(r, p, levels=5)
    with pytest.raises(ValueError, match="one non-negative weight per level"):
        residual_norm(r, p, levels=2, weights=(1.0,))
    with pytest.raises(ValueError, match=r"r must be the residual on the block"):
        residual_norm(r[:, :8], p)
    with pytest.raises(ValueError, match="positive"):
        residual_norm(r, p, coefficient=-torch.ones(16, 16))
    with pytest.raises(ValueError, match="broadcastable"):
        residual_norm(r, p, coefficient=torch.ones(3, 16))
    assert torch.allclose(residual_norm(r, p, coefficient=4.0), residual_norm(r, p) / 4)
    # level 0 with a reaction c weighs the integral of r^2 by 1 / (c + 2 / h^2)
    h = p.spacing[0]
    one_level = residual_norm(r, p, reaction=torch.tensor([0.0, 50.0]), levels=1, interior=0)
    assert torch.allclose(one_level, r.square().sum((1, 2)) * h * h
                          / torch.tensor([2 / h**2, 50 + 2 / h**2], dtype=r.dtype))
    with pytest.raises(ValueError, match="reaction"):
        residual_norm(r, p, reaction=-1.0)
    with pytest.raises(ValueError, match="per sample"):
        residual_norm(r, p, reaction=torch.ones(5))
    with pytest.raises(ValueError, match="advection must be >= 0"):
        residual_norm(r, p, advection=-2.0)
    k = math.sqrt(2) / h
    with_flow = residual_norm(r, p, advection=7.0, reaction=3.0, levels=1, interior=0)
    assert torch.allclose(with_flow, r.square().sum((1, 2)) * h * h / (3 + 7 * k + k * k))
    with pytest.raises(ValueError, match="residual_norm"):
        get_problem("poisson", grid=(16, 16), loss="residual", residual_norm="h-1")


# -- the conditioning claim ---------------------------------------------------------------------
def laplacian(n):
    """The 5-point -Laplacian on the (n - 2)^2 interior nodes of an n x n grid of [0, 1]^2,
    zero Dirichlet values (dense), and the spacing."""
    h = 1.0 / (n - 1)
    t = sp.diags([1.0, -2.0, 1.0], [-1, 0, 1], (n - 2, n - 2)) / h ** 2
    eye = sp.identity(n - 2)
    return -(sp.kron(t, eye) + sp.kron(eye, t)).toarray(), h


def norm_matrix(n):
    """B of the default norm on the interior nodes, q(r) = r^T B r, from its gradient 2 B r
    at the unit vectors (autograd through the function itself)."""
    k = (n - 2) ** 2
    e = torch.zeros((k, n, n), dtype=torch.float64)
    e[:, 1:-1, 1:-1] = torch.eye(k, dtype=torch.float64).view(k, n - 2, n - 2)
    e.requires_grad_()
    q = residual_norm(e, Block((n, n)), spacing=spacing_of((n, n)))
    (grad,) = torch.autograd.grad(q.sum(), e)
    return 0.5 * grad[:, 1:-1, 1:-1].reshape(k, k).numpy()


def norm_apply(x, n):
    """B x on the interior nodes, x (k^2,): half the gradient of the norm at x (autograd)."""
    r = torch.zeros((1, n, n), dtype=torch.float64)
    r[0, 1:-1, 1:-1] = torch.from_numpy(x.reshape(n - 2, n - 2))
    r.requires_grad_()
    q = residual_norm(r, Block((n, n)), spacing=spacing_of((n, n)))
    (grad,) = torch.autograd.grad(q.sum(), r)
    return 0.5 * grad[0, 1:-1, 1:-1].reshape(-1).numpy()


def conds(n):
    """cond(A^T A), cond(A^T B A), and the relative conditions (as ``relative_cond``) of the
    norm and of its cell-mean variant, dense."""
    a, _ = laplacian(n)
    cond = lambda m: (lambda ev: ev[-1] / ev[0])(np.linalg.eigvalsh(m))   # noqa: E731
    w, v = np.linalg.eigh(a)
    root = (v * np.sqrt(w)) @ v.T                                       # A^1/2
    b = norm_matrix(n)
    return (cond(a @ a), cond(a @ b @ a), cond(root @ b @ root),
            cond(root @ cell_mean_matrix(n) @ root))


def relative_cond(n):
    """The condition of u -> ||A u||_B^2 relative to the energy u^T A u: the spread of the
    eigenvalues of A^1/2 B A^1/2 (those of the pencil (A^T B A, A)), by Lanczos, A^1/2 by the
    sine transform that diagonalises A."""
    k, h = n - 2, 1.0 / (n - 1)
    j = np.arange(1, k + 1)
    s = np.sqrt(2 / (k + 1)) * np.sin(np.pi * np.outer(j, j) / (k + 1))   # orthogonal, symmetric
    lam = 4 / h ** 2 * np.sin(np.pi * j / (2 * (k + 1))) ** 2
    root = np.sqrt(lam[:, None] + lam[None, :])
    half = lambda x: (s @ (root * (s @ x.reshape(k, k) @ s)) @ s).reshape(-1)   # noqa: E731
    op = spla.LinearOperator((k * k, k * k), matvec=lambda x: half(norm_apply(half(x), n)),
                             dtype=np.float64)
    top = spla.eigsh(op, k=1, which="LA", return_eigenvectors=False, tol=1e-5)[0]
    low = spla.eigsh(op, k=1, which="SA", return_eigenvectors=False, tol=1e-5)[0]
    return top / low


def cell_mean_matrix(n):
    """B of the same levels with plain cell means instead of tents (the variant the module
    docstring rules out): s_l |c_l| sum over the cells of (mean of r)^2, on the interior."""
    h, k = 1.0 / (n - 1), n - 2
    b, m = np.zeros((k * k, k * k)), 1
    while m <= n - 2:
        cells = np.arange(1, n - 1) // m                    # interior node -> cell, per axis
        p = np.equal.outer(cells, np.unique(cells)).astype(float)
        p2 = np.kron(p, p)
        b += (m * h) ** 2 / 2 * h ** 2 / (m * m) * p2 @ p2.T   # s_l |c_l| (sum / m^2)^2
        m *= 2
    return b


def test_conditioning_grows_like_the_energy_not_its_square():
    (l2_16, ml_16, rel_16, box_16), (l2_32, ml_32, rel_32, box_32) = conds(16), conds(32)
    # squared residual: cond(A)^2 ~ h^-4, about 16x per halving of h
    assert l2_32 / l2_16 > 14
    # the multilevel norm: like the energy, cond(A) ~ h^-2, about 4x per halving
    assert ml_32 / ml_16 < 5.5
    assert ml_16 < l2_16 / 20 and ml_32 < l2_32 / 80
    # equivalent to the energy up to a constant that does not grow with the grid
    rel = [rel_16, rel_32, relative_cond(64)]
    assert max(rel) < 6 and rel[2] / rel[0] < 1.3, rel
    # plain cell means are not enough: their relative condition grows like 1 / h
    assert box_16 > 5 * rel[0] and box_32 / box_16 > 2.2, (box_16, box_32)


def test_docstring_example_runs():
    module = importlib.import_module("diffnet.problems.contract.residual_norm")
    result = doctest.testmod(module)
    assert result.attempted >= 8 and result.failed == 0
