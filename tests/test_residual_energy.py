"""``diffnet.problems.residual_energy``: the energy whose gradient is a symmetric residual. Its
value is the dense quadratic's, its gradient the masked residual, its parts on a split sum to
the undivided value and gradient, and a non-symmetric or non-linear operator is refused."""
from __future__ import annotations

import doctest
import importlib
import math

import pytest
import torch

from diffnet.domain import Block
from diffnet.problems import residual_energy
from diffnet.problems.check.split import ThreadSplit, close, run_blocks, terms_and_grads
from tests.test_operator_norm import CASES, coefficient, diffusion, spacing_of


def field(grid, seed, samples=2, grad=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn((samples, 1, *grid), generator=g, dtype=torch.float64)
    return t.requires_grad_(grad)


def dense(apply, grid, samples):
    """(S, N, N) the matrix of ``apply`` column by column."""
    n = math.prod(grid)
    eye = torch.eye(n, dtype=torch.float64)
    cols = [apply(eye[j].view(1, 1, *grid).expand(samples, 1, *grid).contiguous())
            for j in range(n)]
    return torch.stack([c.flatten(1) for c in cols], dim=2)


def test_value_is_the_quadratic_energy_with_the_boundary_values_fixed():
    grid = (7, 9)
    h = spacing_of(grid)
    a = coefficient(grid, 2, samples=2)
    apply = diffusion(a, Block(grid), h, reaction=0.5)
    f, u = field(grid, 1), field(grid, 2)
    got = residual_energy(apply(u) - f, u, Block(grid), apply, spacing=h)
    mat = dense(apply, grid, 2)
    inner = torch.zeros(grid, dtype=torch.bool)
    inner[1:-1, 1:-1] = True
    i, b = inner.flatten(), ~inner.flatten()
    ui, ub, fi = u.flatten(1)[:, i], u.flatten(1)[:, b], f.flatten(1)[:, i]
    aii, aib = mat[:, i][:, :, i], mat[:, i][:, :, b]
    want = (0.5 * torch.einsum("si,sij,sj->s", ui, aii, ui)
            + torch.einsum("si,sij,sj->s", ui, aib, ub) - (ui * fi).sum(1)) * math.prod(h)
    assert close(got, want, rtol=1e-12), (got, want)


def test_gradient_is_the_residual_on_the_unknown_nodes_and_its_minimiser_the_solution():
    grid = (9, 9)
    h = spacing_of(grid)
    apply = diffusion(coefficient(grid, 3), Block(grid), h)
    f = field(grid, 3, samples=1)
    u = field(grid, 4, samples=1, grad=True)
    r = apply(u) - f
    residual_energy(r, u, Block(grid), apply, spacing=h).sum().backward()
    mask = torch.zeros(1, 1, *grid, dtype=torch.float64)
    mask[..., 1:-1, 1:-1] = 1
    assert close(u.grad, math.prod(h) * mask * r.detach(), rtol=1e-13)
    # the energy gap to the discrete solution is half the error's energy norm
    mat = dense(apply, grid, 1)[0]
    i = mask.flatten().bool()
    star = u.detach().clone().flatten()
    rhs = f.flatten()[i] - mat[i][:, ~i] @ star[~i]
    star[i] = torch.linalg.solve(mat[i][:, i], rhs)
    star = star.view(1, 1, *grid)
    energy = lambda v: residual_energy(apply(v) - f, v, Block(grid), apply, spacing=h)  # noqa
    e = (u.detach() - star) * mask
    gap = (energy(u.detach()) - energy(star))[0]
    assert close(gap, math.prod(h) * (e * apply(e)).sum() / 2, rtol=1e-10)
    assert float(gap) > 0


def energies(block, r, u, a):
    h = spacing_of(block.grid)
    apply = diffusion(block.local(a), block, h)
    return {"default": residual_energy(r, u, block, apply, spacing=h),
            "walls": residual_energy(r, u, block, apply, spacing=h,
                                     interior=(0,) + (1,) * (block.dims - 1))}


@pytest.mark.parametrize("grid,split", CASES, ids=str)
def test_split_value_and_gradient_are_the_undivided_ones(grid, split):
    u = field(grid, sum(grid) + sum(split), grad=True)
    a = coefficient(grid, 4, samples=2)
    f = field(grid, 7)
    whole = diffusion(a, Block(grid), spacing_of(grid))
    ref = terms_and_grads(energies(Block(grid), whole(u) - f, u, a), u)

    def part(b):
        ub = b.local(u)
        return energies(b, diffusion(b.local(a), b, spacing_of(grid))(ub) - b.local(f), ub, a)
    _, parts = run_blocks(ThreadSplit(grid, split), part)
    got = terms_and_grads({k: sum(p[k] for p in parts) for k in parts[0]}, u)
    for k in ref:
        assert close(got[k][0], ref[k][0], rtol=1e-12), (k, got[k][0], ref[k][0])
        assert close(got[k][1], ref[k][1], rtol=1e-12), k
        assert ref[k][1].abs().max() > 0, k


# real mpiexec -n 2: tests/mpi_scripts/operator_norm_check.py checks the energy beside the norm


def refusal(match, u=None, grid=(9, 9), apply=None, r=None, **kw):
    h = spacing_of(grid)
    u = field(grid, 0, samples=1) if u is None else u
    apply = diffusion(coefficient(grid, 1), Block(grid), h) if apply is None else apply
    r = apply(u) if r is None else r
    kw.setdefault("spacing", h)
    with pytest.raises(ValueError, match=match):
        residual_energy(r, u, Block(grid), apply, **kw)


def test_bad_input_is_refused_with_the_fix():
    grid, h = (9, 9), spacing_of((9, 9))
    lap = diffusion(torch.ones(1, 1, *grid, dtype=torch.float64), Block(grid), h)
    refusal(r"residual_energy needs a symmetric operator.*residual_norm",
            apply=lambda v: lap(v) + 50 * (v - torch.roll(v, 1, dims=-1)))
    refusal(r"residual_energy: apply is not a linear operator",
            apply=lambda v: lap(v) * (1 + v))
    refusal(r"r must be one field on the grid", r=torch.zeros(1, 2, 9, 9))
    refusal(r"u must be one field on the grid", u=torch.zeros(1, 8, 9), r=torch.zeros(1, 9, 9))
    refusal(r"r and u must have the same shape", r=torch.zeros(2, 1, 9, 9))
    refusal(r"needs spacing=", spacing=None)


def test_unchecked_call_skips_the_probe():
    grid, h = (9, 9), spacing_of((9, 9))
    calls = []
    lap = diffusion(torch.ones(1, 1, *grid, dtype=torch.float64), Block(grid), h)
    counted = lambda v: calls.append(1) or lap(v)                   # noqa: E731
    u = field(grid, 1, samples=1)
    residual_energy(lap(u), u, Block(grid), counted, spacing=h, check=False)
    assert len(calls) == 1          # the value's one application, no probes
    residual_energy(lap(u), u, Block(grid), counted, spacing=h)
    assert len(calls) == 1 + 1 + 9 + 1


def test_docstring_example_runs():
    module = importlib.import_module("diffnet.problems.contract.residual_energy")
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
