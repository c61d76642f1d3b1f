"""Under mpiexec -n P: a U-Net split over a domain group (diffnet.split_layers on
deepfusion.engine.parallel.halo's MPIBlock) against the undivided U-Net (float64). Rank 0 prints one
``OK ...`` line per case; any failure aborts the job non-zero with the traceback on stderr.

Each argument is a case ``GRID:SPLIT:OPTIONS``, e.g. ``16x32:2x2:instance,avgpool,cl``:
OPTIONS (comma-separated) name the norm (instance / none), the downsampling (conv / avgpool),
the upsampling (bilinear / trilinear / transpose), the depth (d1, d2; default 2), ``cl``
(channels_last model and input) and ``ck`` (checkpoint_levels: the halos run again in
backward's recomputation), ``prolong`` (the U-Net on half the grid prolonged to the grid by a
correction network: the gathers around the resampling), ``frozen`` (the same with the inner
network frozen) and ``nest`` (a chain of three: the U-Net on a quarter of the grid, prolonged
twice; split as training grows and re-splits it: on the middle grid first, then on the grid,
checked there, then on the way back down on each inner grid and up again). The world is cut
into domain groups of prod(SPLIT) ranks.

Every rank builds the same network (same seed) and the same global input, runs the undivided
network on the whole field and the split one on its block, and checks: the block of the
undivided output == the split output; the parameter gradients of sum(out * weight field), the
split ones all-reduced over the domain group, == the undivided ones; the input gradient's block
== the split input gradient (all rtol 1e-10, with an absolute floor of 1e-10 * max|want|).
"""
import copy
import math
import sys

import torch

from deepfusion.engine.parallel.comm import world
from tests.mpi_scripts.cases import report_ok, run_cases
from deepfusion.engine.parallel.halo import MPIBlock, domain_groups, make_block
from diffnet.generators import Prolonged, build_generator
from diffnet.split_layers import check_generator_split, split_generator

torch.set_num_threads(1)
WORLD = world()
RTOL = 1e-10


def field(seed, *shape):
    """The same random tensor on every rank that asks for the same seed."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def close(got, want, what):
    tol = RTOL * float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=RTOL, atol=tol, msg=lambda m: f"{what}: {m}")


def build(grid, opts):
    dims = len(grid)
    up = next((o for o in opts if o in ("bilinear", "trilinear", "transpose")),
              "bilinear" if dims == 2 else "trilinear")
    torch.manual_seed(0)
    model = build_generator(
        "unet" if dims == 2 else "unet3d", in_channels=2, depth=2 if "d1" not in opts else 1,
        base_width=4 if dims == 2 else 2, max_width=8,
        norm="none" if "none" in opts else "instance",
        downsample="avgpool" if "avgpool" in opts else "conv", upsample=up,
        checkpoint_levels="ck" in opts).double()
    grown = 2 if "nest" in opts else int("prolong" in opts or "frozen" in opts)
    for k in reversed(range(grown)):  # the U-Net on grid / 2**grown, prolonged up to grid
        model = Prolonged(inner=model, inner_grid=[g // 2 ** (k + 1) for g in grid],
                          grid=[g // 2 ** k for g in grid], in_channels=2,
                          correction={"depth": 1, "base_width": 2},
                          train_inner="frozen" not in opts).double()
        with torch.no_grad():  # a correction that answers (its last layer starts at zero)
            model.correction.outc.weight.normal_()
    return model


def run_once(model, x, w):
    """Output, parameter gradients {name: grad} (of the parameters the grid's networks train)
    and input gradient of sum(model(x) * w)."""
    x = x.detach().clone().requires_grad_(True)
    model.zero_grad()
    out = model(x)
    (out * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads, x.grad


def run(case):
    grid_s, split_s, opts = (case.split(":") + [""])[:3]
    grid = [int(v) for v in grid_s.split("x")]
    split = [int(v) for v in split_s.split("x")]
    opts = opts.split(",")
    dom, _, group, n_groups = domain_groups(WORLD, split)
    block = make_block(dom, grid, split)
    assert isinstance(block, MPIBlock) == (math.prod(split) > 1), block
    model = build(grid, opts)
    check_generator_split(model, grid, split)
    split_model = copy.deepcopy(model)
    if "nest" in opts:  # as a grown network is rewrapped: split on the grid it grew from first
        split_generator(split_model, make_block(dom, model.inner_grid, split))
    split_generator(split_model, block)
    if "cl" in opts:
        fmt = torch.channels_last if len(grid) == 2 else torch.channels_last_3d
        model, split_model = (m.to(memory_format=fmt) for m in (model, split_model))
    compare(model, split_model, block, dom, case, opts)
    if "nest" in opts:  # a V-cycle's way down (the network is its inner one there), and up
        for g in model.grids()[-2::-1] + [tuple(grid)]:
            on = make_block(dom, g, split)
            compare(model, split_generator(split_model, on), on, dom, f"{case} on {g}", opts)
    report_ok(WORLD, f"case={case} groups={n_groups} block={block.shape}")


def compare(model, split_model, block, dom, case, opts):
    """The split network on ``block`` against the undivided one on the block's grid."""
    x, w = field(1, 2, 2, *block.grid), field(2, 2, 1, *block.grid)
    if "cl" in opts:
        x = x.contiguous(memory_format=torch.channels_last if x.dim() == 4
                         else torch.channels_last_3d)
    out, grads, gx = run_once(model, x, w)
    out_s, grads_s, gx_s = run_once(split_model, block.local(x), block.local(w))
    close(out_s, block.local(out), f"{case} output")
    close(gx_s, block.local(gx), f"{case} input gradient")
    assert list(grads_s) == list(grads), f"{case}: gradients of {list(grads_s)}, not {list(grads)}"
    for name, g in grads.items():
        total = grads_s[name].contiguous()
        dom.allreduce_(total.view(-1))  # the blocks' shares of the gradient
        close(total, g, f"{case} gradient of {name}")


if __name__ == "__main__":
    run_cases(WORLD, run, sys.argv[1:])
