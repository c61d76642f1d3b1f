"""Under mpiexec -n P: the operator-preconditioned norm (``diffnet.problems.operator_norm``) and
the energy of a residual (``residual_energy``: each block sums its own nodes) on the blocks of
a real MPI domain split against the undivided values on one process (float64), value and
gradient. The norm: each block probes the operator on its own nodes (its halo from the
neighbours) and gathers the stencil and the residual whole. Each argument is a case
GRIDxSPLIT (``18x12:2x1``: blocks of 9 rows, which the coarse levels straddle). Rank 0
prints one ``OK ...`` line per case."""
import sys

import torch

from deepfusion.engine.parallel.comm import world
from deepfusion.engine.parallel.halo import domain_groups, make_block
from diffnet.domain import Block
from diffnet.problems import operator_norm, residual_energy
from tests.mpi_scripts.cases import (assert_split_matches, grid_and_split, report_ok,
                                     run_cases)
from tests.test_operator_norm import coefficient, diffusion

torch.set_num_threads(1)
WORLD = world()
RTOL = 1e-12


def run(case):
    grid, split = grid_and_split(case)
    dom, _, _, _ = domain_groups(WORLD, split)
    block = make_block(dom, grid, split)
    h = tuple(1.0 / (n - 1) for n in grid)
    r = torch.randn((2, 1, *grid), generator=torch.Generator().manual_seed(5),
                    dtype=torch.float64, requires_grad=True)
    a = coefficient(grid, 4, samples=2)
    ref = operator_norm(r, Block(grid), diffusion(a, Block(grid), h), spacing=h)
    (ref_grad,) = torch.autograd.grad(ref.sum(), r)
    part = operator_norm(block.local(r), block, diffusion(block.local(a), block, h), spacing=h)
    (grad,) = torch.autograd.grad(part.sum(), r)
    assert_split_matches(dom, block.sum(part.detach().contiguous()), ref.detach(), grad,
                         ref_grad, f"case={case}", RTOL)
    energy(dom, block, grid, h, a, case)
    report_ok(WORLD, f"case={case} block={block.shape}")


def energy(dom, block, grid, h, a, case):
    u = torch.randn((2, 1, *grid), generator=torch.Generator().manual_seed(6),
                    dtype=torch.float64, requires_grad=True)
    whole = diffusion(a, Block(grid), h)
    ref = residual_energy(whole(u) - 1, u, Block(grid), whole, spacing=h)
    (ref_grad,) = torch.autograd.grad(ref.sum(), u)
    local, ub = diffusion(block.local(a), block, h), block.local(u)
    part = residual_energy(local(ub) - 1, ub, block, local, spacing=h)
    (grad,) = torch.autograd.grad(part.sum(), u)
    assert_split_matches(dom, block.sum(part.detach().contiguous()), ref.detach(), grad,
                         ref_grad, f"energy case={case}", RTOL)


if __name__ == "__main__":
    run_cases(WORLD, run, sys.argv[1:])
