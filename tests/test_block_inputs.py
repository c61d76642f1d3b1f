"""A rank of a domain split builds only its block's inputs: ``Problem.build_block_input`` gives,
for every registered problem and every block of a split, bit for bit the block of the
whole-grid inputs (``cut(block, build_input(...))``), so a split prediction sees exactly the
inputs an undivided one does."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from diffnet.domain import Block
from diffnet.problems import PROBLEMS, Problem, get_problem
from diffnet.problems.contract.blocks import cut

GRIDS = {2: (16, 12), 3: (8, 8, 12)}       # not square: axes must not be mixed up
SPLITS = {2: ([1, 2], [2, 2]), 3: ([2, 1, 2],)}
# a registered name -> extra configurations (beyond its defaults) whose inputs differ in kind
VARIANTS = {"darcy": [dict(coefficient="lognormal"), dict(family="fine-scale")]}


def configurations():
    for name in sorted(PROBLEMS):
        for kw in [{}] + VARIANTS.get(name, []):
            dims = get_problem(name).dims
            for split in SPLITS[dims]:
                yield pytest.param(name, kw, split, id=f"{name}{kw or ''}-{split}")


def blocks_of(grid, split):
    """Every block of ``grid`` split ``split`` (equal parts per axis), as the engine cuts it."""
    sizes = [g // s for g, s in zip(grid, split)]
    for pos in itertools.product(*(range(s) for s in split)):
        yield Block(grid, [p * n for p, n in zip(pos, sizes)], sizes)


def test_every_registered_problem_is_covered():
    assert {"burgers", "darcy", "poisson", "poisson3d", "reaction_diffusion"} <= set(PROBLEMS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name,kw,split", list(configurations()))
def test_block_inputs_are_the_cut_of_the_whole_inputs_bit_for_bit(name, kw, split, dtype):
    grid = GRIDS[get_problem(name).dims]
    p = get_problem(name, grid=grid, **kw)
    params = p.sample_params(3, range(3))
    whole = p.build_input(params, dtype=dtype)
    for block in blocks_of(grid, split):
        got = p.build_block_input(params, block, dtype=dtype)
        want = cut(block, whole)
        assert got.dtype == dtype and got.shape == (3, len(p.input_channels), *block.shape)
        assert got.is_contiguous()
        assert torch.equal(got, want), (block.start, (got - want).abs().max())
        # the contract's default (build the whole grid, cut) gives the same bits
        assert torch.equal(Problem.build_block_input(p, params, block, dtype), want)
    # the whole grid as one block is build_input itself
    assert torch.equal(p.build_block_input(params, Block(grid), dtype=dtype), whole)


def test_block_inputs_do_not_depend_on_the_problems_own_block():
    """A problem already on a block (``on_block``, as the engine sets it) builds the block it
    is asked for, and its whole-grid ``build_input`` is unchanged."""
    grid = GRIDS[2]
    p = get_problem("poisson", grid=grid)
    params = p.sample_params(0, range(2))
    whole = p.build_input(params)
    block = next(blocks_of(grid, [2, 2]))
    p.on_block(block)
    assert torch.equal(p.build_input(params), whole)
    assert torch.equal(p.build_block_input(params, block), cut(block, whole))


def test_a_block_of_another_grid_is_refused():
    p = get_problem("burgers", grid=GRIDS[2])
    with pytest.raises(ValueError, match=r"block of grid \[32, 32\].*grid \[16, 12\]"):
        p.build_block_input(np.array([[4.0]]), Block((32, 32), (0, 0), (16, 16)))
