"""A built generator made to compute on one block of a split grid (domain parallelism).

This module owns the layer-level rewrite: :func:`split_generator` replaces, in place, every
layer of a U-Net whose output at a node depends on other nodes by a subclass that gets those
nodes through a :class:`diffnet.domain.Block` (halo exchange, sums over the blocks), so the
split computation equals the undivided one up to rounding. The replacements share the original
Parameter objects and keep the state_dict keys, so a checkpoint does not depend on the split.
:func:`check_generator_split` refuses a grid/split/network combination before training.

Each split layer reads its level from its input: a tensor holding the block coarsened by an
integer factor per axis (a U-Net level l holds the block at 1 / 2**l); the Block's collectives
are called with tensors of that level.

Handled: zero-padded convolutions whose output grid is the input grid / stride (the 3x3 ones
and the stride-2 downsampling ones: without a padded copy where the block has a thin ghost
exchange, ``diffnet.ghost_conv``; else halo "zeros", then no padding), bilinear / trilinear
upsampling with align_corners=False (halo "replicate": PyTorch clamps the source index at the
boundary, which the replicated ghost layer reproduces), instance norm (statistics over the
whole field), average pooling with stride = kernel. Local and left as they are: 1x1
convolutions, transposed convolutions with stride = kernel, nearest upsampling, pointwise
activations, concatenation. Anything else is refused with a ValueError, never approximated.
A prolonged network (``diffnet.generators.Prolonged``) splits its correction and its inner
network on their grids and gathers whole fields around the resampling between them
(:func:`split_prolonged`).
Splitting again (another grid of a multigrid schedule) points the same split layers at the
new block.
"""
from __future__ import annotations

import copy
from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn

from diffnet.domain import Block, check_split
from diffnet.generators import (ACTIVATIONS, ConvBlock, Down, Prolonged, UNet, UNet3D, UNetSmall, Up,
                         memory_format_of)
from diffnet.ghost_conv import GhostConv
from diffnet.norms import InstanceNorm, InstanceNormNHWCBlocks
from diffnet.resample import resample_nodes

NETWORKS = (UNet, UNetSmall, UNet3D)
# Elements per float32 slab of the low-precision inference norm (64 MiB).
SLAB_ELEMENTS = 1 << 24
# Containers whose forward only composes children and concatenates channels (exact types: a
# subclass may override forward with anything).
CONTAINERS = (*NETWORKS, ConvBlock, Down, Up, nn.Sequential, nn.ModuleList)
POINTWISE = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.LeakyReLU, nn.Sigmoid, nn.Identity,
             *(type(make()) for make in ACTIVATIONS.values()))  # elementwise: local


def level(block: Block, x: torch.Tensor) -> Block:
    """``block`` at x's resolution (a deeper level of the network): ``Block.at_shape``."""
    return block.at_shape(x.shape[2:])


def narrow_all(y: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """y without ``lo`` leading and ``hi`` trailing layers on every grid axis."""
    for d in range(2, y.dim()):
        y = y.narrow(d, lo, y.shape[d] - lo - hi)
    return y


class SplitLayer:
    """Mixin of the split layers: ``block`` is set by :func:`rebuild`, not by __init__."""

    block: Block

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, block={self.block!r}"


class SplitConv(SplitLayer):
    """A zero-padded convolution: the neighbours' nodes (zeros beyond the global boundary) as
    the padding, then the same convolution unpadded. With stride s the block's output is its
    share of the global output when s divides its start and size (asserted per call)."""

    def forward(self, x):
        lvl = level(self.block, x)
        s = self.stride
        assert all(a % m == 0 and n % m == 0 for a, n, m in zip(lvl.start, lvl.shape, s)), \
            f"stride {s} needs block starts and sizes divisible by it, got {lvl}"
        if lvl.thin_ghosts and set(self.dilation) == {1} and not torch.is_autocast_enabled("cpu"):
            # no padded copy of the block (diffnet.ghost_conv); autocast takes the halo path,
            # where the casts stay autograd's
            return GhostConv.apply(x, self.weight, self.bias, lvl, self.stride,
                                   self.padding[0], self.groups)
        conv = F.conv2d if x.dim() == 4 else F.conv3d
        return conv(lvl.halo(x, self.padding[0], "zeros"), self.weight, self.bias,
                    self.stride, 0, self.dilation, self.groups)


class SplitConv2d(SplitConv, nn.Conv2d):
    pass


class SplitConv3d(SplitConv, nn.Conv3d):
    pass


class SplitUpsample(SplitLayer, nn.Upsample):
    """Linear upsampling (align_corners=False) by an integer factor s: one replicated ghost
    layer, upsample, drop s output layers per side. Inside, the ghosts are the neighbours' nodes;
    at the global boundary PyTorch clamps the source coordinate to the first node, the same as
    interpolating towards a copy of it (up to rounding: 0.25 a + 0.75 a)."""

    def forward(self, x):
        s = int(scale_of(self))
        ghosted = level(self.block, x).halo(x, 1, "replicate")
        y = F.interpolate(ghosted, scale_factor=self.scale_factor, mode=self.mode,
                          align_corners=False)
        return narrow_all(y, s, s)


class SplitAvgPool(SplitLayer):
    """Average pooling with stride = kernel: local, given kernel-aligned blocks (asserted)."""

    def forward(self, x):
        lvl = level(self.block, x)
        k = as_tuple(self.kernel_size, lvl.dims)
        assert all(a % m == 0 and n % m == 0 for a, n, m in zip(lvl.start, lvl.shape, k)), \
            f"pooling {k} needs block starts and sizes divisible by it, got {lvl}"
        return super().forward(x)


class SplitAvgPool2d(SplitAvgPool, nn.AvgPool2d):
    pass


class SplitAvgPool3d(SplitAvgPool, nn.AvgPool3d):
    pass


class SplitInstanceNorm(SplitLayer, InstanceNorm):
    """Instance norm with the per-(sample, channel) statistics of the whole field: the mean from
    the blocks' sums, then (two-pass, so no cancellation when |mean| >> std) the blocks' sums
    of squared deviations. 4-D channels_last input takes the fused NHWC kernel
    (``diffnet.norms.InstanceNormNHWCBlocks``); other input plain autograd ops. Low-precision
    input (bf16 autocast, or a bf16 model in inference) is normalised in float32."""

    def forward(self, x):
        lvl = level(self.block, x)
        if x.dtype in (torch.float16, torch.bfloat16) and not torch.is_autocast_enabled("cpu"):
            # a low-precision model (infer --precision bf16): the statistics in float32 (MPI
            # cannot add bf16, and a bf16 sum over a field keeps ~3 digits), the output in
            # the model's dtype for the next layer
            if not torch.is_grad_enabled():
                return self._normalise_in_slabs(x, lvl)
            return self._normalise(x.float(), lvl, self.weight.float(),
                                   self.bias.float()).to(x.dtype)
        return self._normalise(x, lvl, self.weight, self.bias)

    def _normalise_in_slabs(self, x, lvl):
        """Inference of a low-precision model: the same float32 arithmetic as ``_normalise``,
        a slab of rows (dim 2) at a time, so the float32 temporaries are one slab's, not four
        copies of the field (what made an 8192x8192 bf16 split run out of memory)."""
        n = lvl.nodes()
        axes = tuple(range(2, x.dim()))
        slabs = x.split(max(1, SLAB_ELEMENTS // max(1, x[:, :, :1].numel())), dim=2)
        mean = lvl.sum(sum(s.float().sum(axes, keepdim=True) for s in slabs)) / n
        var = lvl.sum(sum(((s.float() - mean) ** 2).sum(axes, keepdim=True)
                          for s in slabs)) / n
        view = (1, -1) + (1,) * len(axes)
        scale = torch.rsqrt(var + self.eps) * self.weight.float().view(view)
        bias = self.bias.float().view(view)
        out = torch.empty_like(x)
        for s, o in zip(slabs, out.split([s.shape[2] for s in slabs], dim=2)):
            o.copy_((s.float() - mean) * scale + bias)
        return out

    def _normalise(self, x, lvl, weight, bias):
        n = lvl.nodes()  # of the whole field at this level
        if x.dim() == 4 and not x.is_contiguous() and \
                x.is_contiguous(memory_format=torch.channels_last):
            # the fused NHWC kernel with the blocks' sums: the plain-ops path below is a large
            # share of a split step on large grids (``python -m bench.domain_bench --profile``)
            return InstanceNormNHWCBlocks.apply(x, weight, bias, self.eps, lvl.sum, n)
        if x.dtype in (torch.float16, torch.bfloat16):
            x = x.float()
        axes = tuple(range(2, x.dim()))
        mean = lvl.sum(x.sum(axes, keepdim=True)) / n
        d = x - mean
        var = lvl.sum((d * d).sum(axes, keepdim=True)) / n
        view = (1, -1) + (1,) * len(axes)
        scale = torch.rsqrt(var + self.eps) * weight.to(x.dtype).view(view)
        return d * scale + bias.to(x.dtype).view(view)


def rebuild(old: nn.Module, cls: type, block: Block) -> nn.Module:
    """An instance of ``cls`` with ``old``'s state: the same Parameter objects (its own dicts
    holding them, so the original module stays intact) and ``block``."""
    new = cls.__new__(cls)
    new.__dict__.update({k: copy.copy(v) if isinstance(v, (dict, set)) else v
                         for k, v in old.__dict__.items()})
    new.block = block
    return new


def as_tuple(v, dims):
    return (v,) * dims if isinstance(v, int) else tuple(v)


def conv_plan(m, dims):
    """The split class of a convolution (None: local as it is), or the reason it is refused."""
    k, s, d = (as_tuple(v, dims) for v in (m.kernel_size, m.stride, m.dilation))
    if isinstance(m.padding, str):
        return f"string padding {m.padding!r}; give the padding as an int"
    p = as_tuple(m.padding, dims)
    if m.padding_mode != "zeros" or len(set(p)) != 1:
        return f"padding {p} mode {m.padding_mode!r}; only equal zero padding on every axis"
    # The output grid must be the input grid / stride for every stride-aligned block.
    if not all(di * (ki - 1) + 1 - si <= 2 * p[0] <= di * (ki - 1) for ki, si, di in zip(k, s, d)):
        return f"kernel {k}, stride {s}, padding {p} do not map the grid to grid / stride"
    if set(k) == {1} and set(s) == {1}:
        return None
    return SplitConv2d if dims == 2 else SplitConv3d


def leaf_plan(m: nn.Module, dims: int):
    """(split class or None, refusal reason or None) of a leaf module."""
    t = type(m)
    if t in (nn.Conv2d, nn.Conv3d, SplitConv2d, SplitConv3d):
        plan = conv_plan(m, dims)
        return (None, plan) if isinstance(plan, str) else (plan, None)
    if t in (nn.ConvTranspose2d, nn.ConvTranspose3d):
        k, s = as_tuple(m.kernel_size, dims), as_tuple(m.stride, dims)
        ok = (k == s and set(as_tuple(m.padding, dims)) == {0} and set(m.dilation) == {1}
              and set(as_tuple(m.output_padding, dims)) == {0})
        return None, None if ok else "transposed convolution other than stride = kernel, no padding"
    if t in (nn.AvgPool2d, nn.AvgPool3d, SplitAvgPool2d, SplitAvgPool3d):
        ok = (as_tuple(m.kernel_size, dims) == as_tuple(m.stride or m.kernel_size, dims)
              and set(as_tuple(m.padding, dims)) == {0})
        cls = SplitAvgPool2d if dims == 2 else SplitAvgPool3d
        return (cls, None) if ok else (None, "pooling other than stride = kernel, no padding")
    if t in (nn.Upsample, SplitUpsample):
        return upsample_plan(m, dims)
    if t in (InstanceNorm, SplitInstanceNorm):
        return SplitInstanceNorm, None
    if t in POINTWISE:
        return None, None
    return None, "a layer split_layers does not know how to split"


def scale_of(m: nn.Upsample) -> float | None:
    """The one scale factor of all axes, or None (a fixed size, or factors that differ)."""
    sf = m.scale_factor
    sf = set(sf) if isinstance(sf, tuple) else {sf}
    return sf.pop() if len(sf) == 1 and m.size is None else None


def upsample_plan(m: nn.Upsample, dims: int):
    s = scale_of(m)
    if s is None or s != int(s) or s < 1:
        return None, f"size {m.size}, scale factor {m.scale_factor}; only one integer factor"
    if m.mode == "nearest":
        return None, None
    if m.mode == ("bilinear", "trilinear")[dims - 2] and not m.align_corners:
        return SplitUpsample, None
    return None, f"upsampling mode {m.mode!r} align_corners={m.align_corners}"


def plan(model: nn.Module) -> list:
    """[(parent, name, split class)] for the layers to replace; ValueError naming the first
    layer that cannot be split (before anything is changed)."""
    if type(model) not in NETWORKS:
        raise ValueError(f"{type(model).__name__} cannot be split over a domain: only the "
                         f"U-Nets {[c.__name__ for c in NETWORKS]} can")
    out = []
    for pname, parent in model.named_modules():
        if type(parent) not in CONTAINERS:
            continue
        for name, child in parent.named_children():
            if type(child) in CONTAINERS:
                continue
            cls, reason = leaf_plan(child, model.dims)
            if reason:
                where = f"{pname}.{name}" if pname else name
                raise ValueError(f"cannot split layer {where} ({child}) over a domain: {reason}")
            if cls is not None:
                out.append((parent, name, cls))
    return out


def check_split_input(self, x: torch.Tensor) -> None:
    """The network's input check for a block: x must be the block of a valid global input
    (the grid conditions, e.g. instance norm's coarsest level, are the global grid's)."""
    block = self.domain_block
    if tuple(x.shape[2:]) != block.shape:
        raise ValueError(f"input {tuple(x.shape)} is not this block {block.shape} of the grid")
    whole = torch.empty((*x.shape[:2], *block.grid), device="meta")
    type(self).check_input(self, whole)


def split_generator(model: nn.Module, block: Block) -> nn.Module:
    """Make the built U-Net ``model`` compute on ``block`` (in place; returns it): its input is
    the block of the global input (``block.local(x)``) and its output the block of the global
    output. ValueError if a layer cannot be split exactly or the block is not aligned to
    2**depth. Parameters and state_dict keys are unchanged. A prolonged network: see
    :func:`split_prolonged`."""
    if isinstance(model, Prolonged):
        return split_prolonged(model, block)
    todo = plan(model)
    if block.dims != model.dims:
        raise ValueError(f"a {model.dims}-D network cannot run on the {block.dims}-D block {block}")
    multiple = 2 ** model.depth
    if any(s % multiple or n % multiple for s, n in zip(block.start, block.shape)):
        raise ValueError(f"{block}: block starts and sizes must be multiples of 2**depth = "
                         f"{multiple} (depth={model.depth})")
    for parent, name, cls in todo:
        child = getattr(parent, name)
        if type(child) is cls:  # split before (another grid): the module itself is kept
            child.block = block
        else:
            setattr(parent, name, rebuild(child, cls, block))
    model.domain_block = block
    model.check_input = MethodType(check_split_input, model)
    return model


def split_prolonged(model: Prolonged, block: Block) -> Prolonged:
    """A prolonged network on ``block`` (in place; returns it). Its correction is split on
    ``block``, its inner network on the same split of ``inner_grid`` (``Block.in_grid``), so
    every rank does its share of both. The resampling between the grids is node-aligned
    (``align_corners=True``), which no block can do from its own nodes: the block's input
    fields are gathered whole before R, and the inner network's blocks gathered whole before
    P, whose result is cut back to the block. Those are the only collectives added; the
    gathers' adjoints give each block its share of the gradient, so the split equals the
    undivided network up to rounding. On another grid the network is its inner network."""
    if block.grid != model.grid:
        split_generator(model.inner, block)
    else:
        split_generator(model.correction, block)
        split_generator(model.inner, block.in_grid(model.inner_grid))
    model.domain_block = block
    model.forward = MethodType(prolonged_on_block, model)
    model.check_input = MethodType(check_prolonged_block_input, model)
    return model


def prolonged_on_block(self: Prolonged, x: torch.Tensor) -> torch.Tensor:
    """``Prolonged.forward`` on this rank's block (see :func:`split_prolonged`)."""
    block = self.domain_block
    if block.grid != self.grid:
        return self.inner(x)
    inner_block = block.in_grid(self.inner_grid)
    fields = inner_block.local(resample_nodes(block.gather_whole(x), self.inner_grid))
    with torch.set_grad_enabled(self.train_inner and torch.is_grad_enabled()):
        coarse = self.inner(fields.contiguous(memory_format=memory_format_of(x)))
    if coarse.dtype in (torch.bfloat16, torch.float16):
        coarse = coarse.float()  # the gather's adjoint sums gradients: MPI sums no bfloat16
    coarse = block.local(resample_nodes(inner_block.gather_whole(coarse), self.grid))
    return self.corrected(x, coarse.to(x.dtype))


def check_prolonged_block_input(self: Prolonged, x: torch.Tensor) -> None:
    """A split prolonged network's input check: x must be this block of the grid (the
    networks of the chain were checked against their grids when split)."""
    block = self.domain_block
    if tuple(x.shape[2:]) != block.shape:
        raise ValueError(f"input {tuple(x.shape)} is not this block {block.shape} of the grid")


def check_generator_split(model: nn.Module, grid, split) -> None:
    """ValueError before training unless ``model`` can be split (see :func:`split_generator`)
    into ``split`` blocks of ``grid`` whose sides are multiples of 2**depth, naming the nearest
    valid grids and splits. A prolonged network: its correction on ``grid`` and its inner
    network on the same split of its own grid, the message naming which (down the chain)."""
    if isinstance(model, Prolonged):
        if tuple(int(g) for g in grid) != model.grid:
            return check_generator_split(model.inner, grid, split)
        for net, on, what in ((model.correction, model.grid, "the correction network"),
                              (model.inner, model.inner_grid, "the network it grew from")):
            try:
                check_generator_split(net, on, split)
            except ValueError as e:
                raise ValueError(f"{what} on {list(on)}: {e}") from None
        return
    plan(model)
    check_split(grid, split, 2 ** model.depth)
