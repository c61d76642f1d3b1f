"""The split-exact helpers (``diffnet.problems.contract.blocks``, the ``Problem`` methods ``mean``,
``wall_mean``, ``edges``, ``total``, ``share``): on every block of a split grid, 1-D to 3-D,
the parts of a loss written with them sum to the undivided loss, value and gradient; undivided
they are the plain torch expressions; a problem that declares terms it cannot split is refused
on a split, naming them. Blocks run in threads of this process (``check_split``)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from diffnet.domain import Block
from diffnet.problems import Axis, Problem
from diffnet.problems.contract.blocks import SIDES, edges, node_mean, share, total, wall_mean
from diffnet.problems.check.split import (ThreadSplit, close, run_blocks, terms_and_grads)

CASES = [((12,), (2,)), ((12,), (4,)), ((8, 12), (1, 2)), ((8, 12), (2, 2)), ((8, 12), (4, 3)),
         ((8, 4, 6), (2, 1, 2)), ((8, 4, 6), (2, 2, 3))]


def helper_terms(block, u: torch.Tensor) -> dict:
    """A loss of every kind the helpers cover, on this block's part u (B, 2, *shape)."""
    d = block.dims
    dims = tuple(range(1, u.dim()))
    nu = 1 + u[:, :1].square()
    return {
        "mean": node_mean(block, u.square()),
        "interior": node_mean(block, u.sin(), interior=1),
        "first_axis_interior": node_mean(block, u[:, 1], interior=(2,) + (0,) * (d - 1)),
        "walls": sum(wall_mean(block, (u - 0.3).square(), a, s) for a in range(d) for s in SIDES),
        "edges": sum((b - a).square().sum(dims) for a, b in edges(block, u)),
        "edge_pairs": sum((2 * n0 * n1 / (n0 + n1) * (b - a).square()).sum(dims)
                          for (a, n0), (b, n1) in edges(block, (u, nu))),
        # a non-linear reduction: a norm over the whole grid, shared out over the blocks
        "norm": share(block, total(block, u.square().sum(dims)).sqrt()),
    }


@pytest.mark.parametrize("grid,split", CASES, ids=str)
def test_helper_terms_split_exactly(grid, split):
    g = torch.Generator().manual_seed(len(grid) * 10 + sum(split))
    raw = torch.randn((2, 2, *grid), generator=g, dtype=torch.float64, requires_grad=True)
    ref = terms_and_grads(helper_terms(Block(grid), raw), raw)
    ts = ThreadSplit(grid, split)
    _, parts = run_blocks(ts, lambda b: helper_terms(b, b.local(raw)))
    got = terms_and_grads({k: sum(p[k] for p in parts) for k in parts[0]}, raw)
    for k in ref:
        assert close(got[k][0], ref[k][0]), (k, got[k][0], ref[k][0])
        assert close(got[k][1], ref[k][1]), k
        assert ref[k][1].abs().max() > 0, k          # not vacuous


def test_undivided_helpers_are_the_plain_torch_expressions():
    t = torch.randn(3, 2, 7, 5, dtype=torch.float64)
    whole = Block((7, 5))
    assert torch.equal(node_mean(whole, t), t.mean(dim=(1, 2, 3)))
    # a cut is averaged as a field computed on the cut (contiguous), the way a loss slices
    inner = t[..., 1:-1, 1:-1].contiguous()
    assert torch.equal(node_mean(whole, t, interior=1), inner.mean(dim=(1, 2, 3)))
    assert torch.equal(node_mean(whole, t, interior=(0, 2)),
                       t[..., 2:-2].contiguous().mean(dim=(1, 2, 3)))
    assert torch.equal(wall_mean(whole, t, 0, "lo"), t[:, :, 0].contiguous().mean(dim=(1, 2)))
    assert torch.equal(wall_mean(whole, t, 1, "hi"), t[..., -1].contiguous().mean(dim=(1, 2)))
    (y0, y1), (x0, x1) = edges(whole, t)
    assert torch.equal(y1 - y0, t[..., 1:, :] - t[..., :-1, :])
    assert torch.equal(x1 - x0, t[..., 1:] - t[..., :-1])
    s = t.sum(dim=(1, 2, 3))
    assert torch.equal(share(whole, total(whole, s)), s)


def test_bad_helper_arguments_say_what_is_wrong():
    t, blk = torch.zeros(1, 1, 6, 6), Block((6, 6))
    with pytest.raises(ValueError, match="interior must be an integer >= 0 or one per grid axis"):
        node_mean(blk, t, interior=3)
    with pytest.raises(ValueError, match="a wall is an axis in 0..1 and a side in"):
        wall_mean(blk, t, 0, "left")


class Fit(Problem):
    """pde = mean (u - f)^2 (split-exact), or declared whole-grid only by ``unsplit_terms``."""

    name = "fit"
    param_names = ("a",)
    input_channels = ("f",)

    def __init__(self, *, grid=(8, 8), whole_only: bool = False):
        super().__init__(grid=grid)
        self.whole_only = whole_only
        self.unsplit_terms = ("pde",) if whole_only else ()

    @property
    def axes(self):
        return (Axis("y", 0.0, 1.0), Axis("x", 0.0, 1.0))

    def param_bounds(self):
        return np.array([[0.0, 1.0]])

    def build_input(self, params, dtype=torch.float32):
        return torch.ones((len(params), 1, *self.grid), dtype=dtype) * torch.as_tensor(
            np.asarray(params)[:, :1, None, None], dtype=dtype)

    def impose(self, u, inputs):
        return u

    def loss_terms(self, u, inputs):
        pde = self.mean((u - inputs).square())
        return {"pde": pde, "bc": self.wall_mean(u.square(), 0, "lo")}


def test_a_problem_declaring_unsplit_terms_is_refused_on_a_split_naming_them():
    blk = ThreadSplit((8, 8), (1, 2)).blocks()[0]
    Fit().on_block(blk)                                   # written with the helpers: accepted
    Fit(whole_only=True).on_block(Block((8, 8)))          # the whole grid: accepted
    with pytest.raises(ValueError, match=r"'fit' computes its loss term\(s\) \['pde'\] on the "
                                         r"whole grid only .*parallel.domain = \[\]"):
        Fit(whole_only=True).on_block(blk)
