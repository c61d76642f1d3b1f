"""The copy-free split convolution (diffnet.ghost_conv) against the padded-copy one, in float64.

``SlabBlock`` is a block of a layer whose global input is known: its ghost slabs are cut from
the zero-padded global field, and its ``add_ghost_grads`` records what would be sent back. So
the local arithmetic (the thin corrections and their adjoint) is checked here exactly, block
by block; the exchange itself (deepfusion's MPI block) is checked by the split-network tests
with real processes (test_split_unet_mpi, test_domain_train).
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from diffnet.domain import Block
from diffnet.ghost_conv import GhostConv


class SlabBlock(Block):
    thin_ghosts = True

    def __init__(self, field, start, shape):
        super().__init__(field.shape[2:], start, shape)
        self.field, self.sent = field, None

    def padded(self, field, w):
        """This block's window of the zero-padded global ``field`` (its halo)."""
        p = Block(self.grid).halo(field, w)
        for a, (s, n) in enumerate(zip(self.start, self.shape)):
            p = p.narrow(2 + a, s, n + 2 * w)
        return p

    def ghost_slabs(self, x, width):
        return [[s.clone() if s is not None else None for s in pair]
                for pair in self.slabs_of(self.padded(self.field, width), width)]

    def add_ghost_grads(self, grad_x, grads, width):
        self.sent = (grad_x.clone(), grads)


def blocks(grid, split):
    shape = [g // s for g, s in zip(grid, split)]
    for idx in itertools.product(*(range(s) for s in split)):
        yield [i * n for i, n in zip(idx, shape)], shape


CASES = [((8, 12), (2, 3), dict(kernel_size=3, padding=1)),
         ((8, 12), (2, 3), dict(kernel_size=3, padding=1, stride=2)),
         ((8, 12), (2, 2), dict(kernel_size=5, padding=2)),
         ((8, 12), (2, 2), dict(kernel_size=3, padding=1, groups=2)),
         ((4, 8, 4), (2, 2, 2), dict(kernel_size=3, padding=1)),
         ((4, 8, 4), (2, 2, 1), dict(kernel_size=3, padding=1, stride=2))]


@pytest.mark.parametrize("grid,split,kw", CASES)
def test_ghost_conv_equals_the_padded_copy_and_so_does_its_adjoint(grid, split, kw):
    dims = len(grid)
    torch.manual_seed(0)
    conv = (torch.nn.Conv2d if dims == 2 else torch.nn.Conv3d)(4, 6, **kw).double()
    field = torch.randn(2, 4, *grid, dtype=torch.float64)
    stride, w = conv.stride, conv.padding[0]
    plain = F.conv2d if dims == 2 else F.conv3d
    for start, shape in blocks(grid, split):
        blk = SlabBlock(field, start, shape)
        p = blk.padded(field, w).clone().requires_grad_()
        want = plain(p, conv.weight, conv.bias, stride, 0, 1, conv.groups)
        gy = torch.randn_like(want)
        gp, gw, gb = torch.autograd.grad(want, (p, conv.weight, conv.bias), gy)

        x = Block(grid, start, shape).local(field).clone().requires_grad_()
        got = GhostConv.apply(x, conv.weight, conv.bias, blk, stride, w, conv.groups)
        assert_close(got, want)
        hx, hw, hb = torch.autograd.grad(got, (x, conv.weight, conv.bias), gy)
        assert_close(hw, gw)
        assert_close(hb, gb)
        sent_x, sent = blk.sent
        interior = gp
        for a, n in enumerate(shape):
            interior = interior.narrow(2 + a, w, n)
        assert_close(sent_x, interior)     # before the neighbours' returns are added
        assert_close(hx, interior)
        for a, (pair, ref) in enumerate(zip(sent, blk.slabs_of(gp, w))):
            for g, r in zip(pair, ref):
                if r is None:              # the global boundary: zeros, nothing sent
                    assert g is None
                else:                      # ghost layers no window read: None or zeros
                    assert_close(g if g is not None else torch.zeros_like(r), r)


def test_a_whole_block_is_the_plain_convolution():
    torch.manual_seed(1)
    conv = torch.nn.Conv2d(3, 5, 3, padding=1).double()
    x = torch.randn(1, 3, 6, 10, dtype=torch.float64, requires_grad=True)
    got = GhostConv.apply(x, conv.weight, conv.bias, Block((6, 10)), conv.stride, 1, 1)
    assert_close(got, conv(x))
    got.sum().backward()
    assert x.grad is not None
