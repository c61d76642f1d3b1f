"""A zero-padded convolution on one block of a split grid, without a padded copy of the block.

A split convolution needs the neighbours' nodes as its padding. Copying the block into a
padded buffer (``Block.halo``) costs a full pass over the activations in the forward and two in
the backward, for every convolution of the network: most of the halo's share of a split step.
This module owns the copy-free alternative. By linearity,

    conv(halo(x)) = conv(x, zero padding) + conv(G),

where G is the padded grid holding only the ghost layers (zeros inside). G is nonzero in a thin
frame, so conv(G) touches only the output layers next to the block's faces. The ghosts come as
thin slabs from ``Block.ghost_slabs`` (each ghost node in exactly one slab: the slab of axis a
spans the padded extent of the axes before a and the interior of the axes after it), and each
slab's contribution is one small convolution of a thin region, added in place to the output.
The backward is the same in reverse: the full convolution's backward once, the thin regions'
backward, and the slabs' gradients sent back to their owners by ``Block.add_ghost_grads``,
added in place to the input's gradient (no full-size temporary).

Exact up to rounding (the sums are regrouped); float64 tests compare it with the halo path.
Needs dilation 1 and a block with ``thin_ghosts`` (the MPI blocks); otherwise the split layers
use ``Block.halo``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

CONV = {2: F.conv2d, 3: F.conv3d}


def region(slab: torch.Tensor, axis: int, hi: bool, n: int, kernel: int, stride: int,
           width: int, dims: int):
    """The thin region of the ghost-only padded grid G that the output layers next to one face
    read: (first output layer, output layer count, region, slab layers used), with count 0 and
    region None if no window of the convolution reaches that face's ghosts (the upper face of a
    stride-2 convolution on an even block).

    Along ``axis`` the region holds the slab's ghost layers the windows read (the first ``used``
    layers of the region on the lower face, the last on the upper) and zeros for the interior
    layers they also cover; along the axes after ``axis`` it is zero-padded by ``width`` (their
    ghosts belong to their own slabs); along the axes before it the slab already spans the
    padded extent.
    """
    d, w, s, k = 2 + axis, width, stride, kernel
    m = (n + 2 * w - k) // s + 1                        # output layers along axis
    if not hi:
        first, count = 0, -(-w // s)                    # windows starting inside the ghosts
        length = s * (count - 1) + k
        used, zeros = min(w, length), length - min(w, length)
    else:
        first = max(0, -(-(n + w - k + 1) // s))        # windows reaching the upper ghosts
        count = m - first
        if count <= 0:
            return first, 0, None, 0
        lo, end = s * first, s * (m - 1) + k            # the region in padded coordinates
        assert lo <= n + w < end <= n + 2 * w, (lo, end, n, w)
        used, zeros = end - n - w, n + w - lo
    parts = [slab.narrow(d, 0, used)]
    if zeros:
        shape = list(parts[0].shape)
        shape[d] = zeros
        z = parts[0].new_zeros(shape)
        parts = [z] + parts if hi else parts + [z]
    r = torch.cat(parts, dim=d) if len(parts) > 1 else parts[0]
    pad = []
    for b in reversed(range(dims)):                     # F.pad lists the last axis first
        pad += [w, w] if b > axis else [0, 0]
    return first, count, F.pad(r, pad), used


def slab_grad(grad_r: torch.Tensor, axis: int, hi: bool, used: int, width: int, dims: int,
              shape) -> torch.Tensor:
    """The gradient of a slab (``shape``) from the gradient of its region (adjoint of
    :func:`region`): without the zero padding of the later axes and the zero layers along
    ``axis``; ghost layers no window read get zeros."""
    d, w = 2 + axis, width
    for b in range(axis + 1, dims):
        grad_r = grad_r.narrow(2 + b, w, grad_r.shape[2 + b] - 2 * w)
    part = grad_r.narrow(d, grad_r.shape[d] - used if hi else 0, used)
    if used == shape[d]:
        return part
    out = grad_r.new_zeros(shape)
    out.narrow(d, 0, used).copy_(part)
    return out


class GhostConv(torch.autograd.Function):
    """y = conv(halo(x), weight, bias, stride) of a zero-padded convolution on ``block``,
    computed as conv(x, padding) plus the slabs' thin corrections (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, block, stride, width, groups):
        dims = block.dims
        conv = CONV[dims]
        y = conv(x, weight, bias, stride, width, 1, groups)
        kernel = weight.shape[2:]
        regions = []
        for a, pair in enumerate(block.ghost_slabs(x, width)):
            for hi, slab in enumerate(pair):
                if slab is None:
                    continue
                first, count, r, used = region(slab, a, bool(hi), x.shape[2 + a], kernel[a],
                                               stride[a], width, dims)
                if count:
                    y.narrow(2 + a, first, count).add_(conv(r, weight, None, stride, 0, 1,
                                                            groups))
                    regions.append((a, hi, first, count, r, used, tuple(slab.shape)))
        ctx.save_for_backward(x, weight)
        ctx.block, ctx.stride, ctx.width, ctx.groups = block, stride, width, groups
        ctx.regions, ctx.has_bias = regions, bias is not None
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        block, dims, w = ctx.block, ctx.block.dims, ctx.width
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        args = (ctx.stride, [w] * dims, [1] * dims, False, [0] * dims, ctx.groups)
        gx, gw, gb = torch.ops.aten.convolution_backward(
            gy, x, weight, [weight.shape[0]] if ctx.has_bias else None, *args,
            [need_x, need_w, need_b and ctx.has_bias])
        slab_grads = [[None, None] for _ in range(dims)]
        thin = (ctx.stride, [0] * dims, [1] * dims, False, [0] * dims, ctx.groups)
        for a, hi, first, count, r, used, shape in ctx.regions:
            gr, gwr, _ = torch.ops.aten.convolution_backward(
                gy.narrow(2 + a, first, count), r, weight, None, *thin, [need_x, need_w, False])
            if need_w:
                gw.add_(gwr)
            if need_x:
                slab_grads[a][hi] = slab_grad(gr, a, bool(hi), used, w, dims, shape)
        if need_x:
            block.add_ghost_grads(gx, slab_grads, w)
        return gx, gw, gb, None, None, None, None

