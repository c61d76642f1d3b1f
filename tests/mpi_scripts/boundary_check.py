"""Under mpiexec -n P: the boundary helpers and cell means (``diffnet.problems``: dirichlet,
neumann, robin, cell_means) on the blocks of a real MPI domain split against the undivided
values on one process (float64), value and gradient. Each argument is a case GRIDxSPLIT
(``12x16:1x2``: blocks 12 x 8, so cells of 3 nodes straddle the blocks and go through
``block.sum``). Rank 0 prints one ``OK ...`` line per case."""
import sys

import torch

from deepfusion.engine.parallel.comm import world
from deepfusion.engine.parallel.halo import domain_groups, make_block
from tests.mpi_scripts.cases import (assert_split_matches, grid_and_split, report_ok,
                                     run_cases)
from tests.test_boundary import box, helper_terms

torch.set_num_threads(1)
WORLD = world()
RTOL = 1e-12


def run(case):
    grid, split = grid_and_split(case)
    dom, _, _, _ = domain_groups(WORLD, split)
    block = make_block(dom, grid, split)
    g = torch.Generator().manual_seed(sum(grid))
    raw = torch.randn((2, 1, *grid), generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn((2, 2, *grid), generator=g, dtype=torch.float64)
    ref = helper_terms(box(grid), raw, x)
    part = helper_terms(box(grid).on_block(block), block.local(raw), block.local(x))
    torch.testing.assert_close(part["imposed"], block.local(ref["imposed"]), rtol=0, atol=0)
    for k in (k for k in ref if not k.startswith(("imposed", "cell field"))):
        (ref_grad,) = torch.autograd.grad(ref[k].sum(), raw, retain_graph=True)
        if part[k].requires_grad:
            (grad,) = torch.autograd.grad(part[k].sum(), raw, retain_graph=True)
        else:       # a block away from the term's walls: no part, but the others' backward
            grad = torch.zeros_like(raw)
        assert_split_matches(dom, block.sum(part[k].detach().contiguous()), ref[k].detach(),
                             grad, ref_grad, f"case={case} term={k}", RTOL)
    report_ok(WORLD, f"case={case} block={block.shape}")


if __name__ == "__main__":
    run_cases(WORLD, run, sys.argv[1:])
