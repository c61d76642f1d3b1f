"""Under mpiexec -n P: the MPI domain block (deepfusion.engine.parallel.halo) against the undivided
computation on one process (float64). Each argument is a case GRIDxSPLIT, e.g. ``8x12:1x2``:
the world is cut into domain groups of prod(split) ranks and every check runs on each group.
Rank 0 prints one ``OK ...`` line per case; any failure aborts the job non-zero with the
traceback on stderr.

Checks: block geometry and tiling; halo forward == the block's window of F.pad of the global
field (zeros / replicate, widths 1 and 2, corners included, contiguous and channels-last,
float64 and float32); the halo adjoint (dot-product test summed over the ranks, and the
assembled gradient == the undivided F.pad gradient); the ghost slabs of the copy-free
convolutions and their adjoint; sum and gather forward and backward;
the refusals (uneven grid, too wide a halo, a world not a multiple of the split).
"""
import itertools
import math
import sys

import numpy as np
import torch
import torch.nn.functional as F

from deepfusion.engine.parallel.comm import world
from tests.mpi_scripts.cases import grid_and_split, report_ok, run_cases
from deepfusion.engine.parallel.halo import MPIBlock, domain_groups, make_block
from diffnet.domain import Block

torch.set_num_threads(1)
WORLD = world()
B, C = 2, 3


def field(seed, *shape, dtype=torch.float64):
    """The same random tensor on every rank that asks for the same seed."""
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed), dtype=dtype)


def windows(grid, split):
    """(block index, start, shape) of every block of the split, in group-rank order."""
    shape = [g // s for g, s in zip(grid, split)]
    for index in itertools.product(*(range(s) for s in split)):
        yield index, [i * n for i, n in zip(index, shape)], shape


def window(t, start, shape, width):
    """The block's window of a tensor padded by ``width`` (ghosts included)."""
    for a, (s, n) in enumerate(zip(start, shape)):
        t = t.narrow(2 + a, s, n + 2 * width)
    return t


def check_geometry(block, dom, grid, split, group, n_groups):
    D = math.prod(split)
    assert (dom.size, dom.rank, group, n_groups) == (D, WORLD.rank % D, WORLD.rank // D,
                                                     WORLD.size // D)
    index = np.unravel_index(dom.rank, split)
    shape = tuple(g // s for g, s in zip(grid, split))
    assert block.shape == shape and block.start == tuple(int(i) * n for i, n in zip(index, shape))
    for a in range(len(grid)):
        assert block.at_lo(a) == (index[a] == 0) and block.at_hi(a) == (index[a] == split[a] - 1)
    cover = np.zeros(grid, dtype=int)  # the group's blocks tile the grid exactly once
    for start, shp in dom.allgather_obj((block.start, block.shape)):
        cover[tuple(slice(s, s + n) for s, n in zip(start, shp))] += 1
    assert (cover == 1).all(), cover


def check_halo_forward(block, grid, case):
    lead = 2 + len(grid)
    for fill, width, dtype, cl in itertools.product(("zeros", "replicate"), (1, 2),
                                                    (torch.float64, torch.float32), (False, True)):
        X = field(1, B, C, *grid, dtype=dtype)
        pad = F.pad(X, [width] * (2 * len(grid)), mode="constant" if fill == "zeros" else fill)
        fmt = torch.channels_last if lead == 4 else torch.channels_last_3d
        x = block.local(X).clone()
        if cl:
            x = x.contiguous(memory_format=fmt)
        y = block.halo(x, width, fill)
        expect = window(pad, block.start, block.shape, width)
        assert torch.equal(y, expect), (case, fill, width, dtype, cl, (y - expect).abs().max())
        if cl and isinstance(block, MPIBlock):
            assert y.is_contiguous(memory_format=fmt), (case, y.stride())
        assert torch.equal(x, block.local(X)), "halo changed its input"


def check_halo_adjoint(block, dom, grid, split, case):
    for fill, width in itertools.product(("zeros", "replicate"), (1, 2)):
        X = field(2, B, C, *grid)
        V = field(3, B, C, *(g + 2 * width for g in grid))  # cotangent on the padded global field
        x = block.local(X).clone().requires_grad_()
        v = window(V, block.start, block.shape, width).clone()
        y = block.halo(x, width, fill)
        y.backward(v)
        # dot-product test: sum_r <halo(x), v> == sum_r <x, halo^T v>
        dots = torch.stack([(y.detach() * v).sum(), (x.detach() * x.grad).sum()])
        dom.allreduce_(dots)
        assert abs(dots[0] - dots[1]) <= 1e-12 * abs(dots[0]), (case, fill, width, dots.tolist())
        # the assembled gradient: the undivided F.pad with every block's window of V
        Xg = X.clone().requires_grad_()
        Pg = Block(grid).halo(Xg, width, fill)
        loss = sum((window(Pg, s, n, width) * window(V, s, n, width)).sum()
                   for _, s, n in windows(grid, split))
        loss.backward()
        torch.testing.assert_close(x.grad, block.local(Xg.grad), rtol=1e-13, atol=1e-13,
                                   msg=lambda m: f"{case} {fill} w={width}: {m}")


def check_ghost_slabs(block, dom, grid, case):
    """The copy-free convolutions' exchange: slabs == the zero-filled halo's ghost layers, and
    add_ghost_grads is their adjoint (dot-product test over the ranks; a None gradient is
    zero)."""
    if not block.thin_ghosts:
        return
    for width in (1, 2):
        X = field(5, B, C, *grid)
        x = block.local(X).clone()
        got = block.ghost_slabs(x, width)
        pad = F.pad(X, [width] * (2 * len(grid)))
        for pair, ref in zip(got, block.slabs_of(window(pad, block.start, block.shape, width),
                                                 width)):
            for g, r in zip(pair, ref):
                assert (g is None) == (r is None), case
                assert g is None or torch.equal(g, r), (case, width, (g - r).abs().max())
        V = field(6, B, C, *(g + 2 * width for g in grid))
        grads = block.slabs_of(window(V, block.start, block.shape, width).clone(), width)
        grads[0][1] = None                         # dropped: must count as zero
        gx = torch.zeros_like(x)
        block.add_ghost_grads(gx, grads, width)
        dots = torch.zeros(2, dtype=torch.float64)
        for pair, gpair in zip(got, grads):
            for g, v in zip(pair, gpair):
                if g is not None and v is not None:
                    dots[0] += (g * v).sum()
        dots[1] = (x * gx).sum()
        dom.allreduce_(dots)
        assert abs(dots[0] - dots[1]) <= 1e-12 * abs(dots[0]), (case, width, dots.tolist())


def check_sum(block, dom, case):
    D = dom.size
    for shape in ((B, C), ()):
        ts = [field(100 + r, *shape) for r in range(D)]
        us = [field(200 + r, *shape) for r in range(D)]
        t = ts[dom.rank].clone().requires_grad_()
        s = block.sum(t)
        assert torch.equal(t.detach(), ts[dom.rank]), "sum changed its input"
        torch.testing.assert_close(s, sum(ts), rtol=1e-14, atol=1e-14)
        s.backward(us[dom.rank])
        torch.testing.assert_close(t.grad, sum(us), rtol=1e-14, atol=1e-14, msg=case)


def check_gather(block, dom, grid, split, case):
    """A per-block profile (the field summed over the block's other axes) gathered along each
    axis == the same profile of the undivided field over the line's slab."""
    for a in range(len(grid)):
        X = field(4 + a, B, C, *grid)
        others = [2 + b for b in range(len(grid)) if b != a]
        x = block.local(X).clone().requires_grad_()
        t = x.sum(others) if others else x
        full = block.gather(t, a)
        slab = X
        for b in range(len(grid)):
            if b != a:
                slab = slab.narrow(2 + b, block.start[b], block.shape[b])
        torch.testing.assert_close(full, slab.sum(others), rtol=1e-13, atol=1e-13, msg=case)
        # backward: every line member's cotangent, summed, then this block's slice
        index = np.unravel_index(dom.rank, split)
        line = [int(np.ravel_multi_index(index[:a] + (i,) + index[a + 1:], split))
                for i in range(split[a])]
        us = {r: field(300 + 10 * a + r, B, C, grid[a]) for r in line}
        full.backward(us[dom.rank])
        n = block.shape[a]
        g = sum(us.values()).narrow(-1, block.start[a], n)
        expect = g.reshape(B, C, *[n if b == a else 1 for b in range(len(grid))]).expand_as(x)
        torch.testing.assert_close(x.grad, expect, rtol=1e-13, atol=1e-13, msg=case)


def check_refusals(dom, grid, split, case):
    uneven = tuple(g + 1 if s > 1 else g for g, s in zip(grid, split))
    if uneven != tuple(grid):
        try:
            make_block(dom, uneven, split)
        except ValueError as e:
            assert "cannot be split" in str(e), e
        else:
            raise AssertionError(f"{case}: grid {uneven} accepted")
    block = make_block(dom, grid, split)
    wide = min(block.shape) + 1
    try:
        block.halo(torch.zeros(B, C, *block.shape), wide)
    except ValueError as e:
        assert "width" in str(e), e
    else:
        if isinstance(block, MPIBlock):
            raise AssertionError(f"{case}: halo width {wide} accepted")
    bad = [1] * (len(grid) - 1) + [3]  # 3 ranks per group: divides neither 2 nor 4
    try:
        domain_groups(WORLD, bad)
    except ValueError as e:
        msg = str(e)
        assert "parallel.domain" in msg and f"{WORLD.size} ranks" in msg, msg
    else:
        raise AssertionError(f"domain_groups accepted {bad} on {WORLD.size} ranks")


def run(case):
    grid, split = grid_and_split(case)
    dom, across, group, n_groups = domain_groups(WORLD, split)
    assert across.size == n_groups and across.rank == group
    assert across.allgather_obj(WORLD.rank) == [WORLD.rank % dom.size + k * dom.size
                                                for k in range(n_groups)]
    block = make_block(dom, grid, split)
    assert isinstance(block, MPIBlock) == (math.prod(split) > 1), block
    check_geometry(block, dom, grid, split, group, n_groups)
    check_halo_forward(block, grid, case)
    check_halo_adjoint(block, dom, grid, split, case)
    check_ghost_slabs(block, dom, grid, case)
    check_sum(block, dom, case)
    check_gather(block, dom, grid, split, case)
    check_refusals(dom, grid, split, case)
    report_ok(WORLD, f"case={case} groups={n_groups} block={block.shape}")


if __name__ == "__main__":
    run_cases(WORLD, run, sys.argv[1:])
