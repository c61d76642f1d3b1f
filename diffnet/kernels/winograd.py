"""The U-Nets' 3x3 stride-1 convolutions by Winograd's F(2x2, 3x3) as compiled kernels
(``winograd.c``), forward and both gradients, and :func:`fuse_winograd`, which puts them into
a built network.

oneDNN computes these convolutions directly: 36 multiplications per 2x2 outputs and channel
pair. Winograd's transforms combine the input patch and the kernel first, so the product takes
16, at the cost of a few additions per tile and a different rounding (about what another
summation order gives; tested against a float64 reference). A convolution runs the kernel when
both its channel counts are multiples of 16 and the field is float32 channels_last with even
sides of at least 8; anything else (the first layer's one or two input channels, the coarsest
levels, NCHW, float64, autocast, tracing) runs oneDNN. The weights and their state-dict keys are the ``nn.Conv2d``'s.
"""
from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F
from torch import nn

from diffnet.kernels.build import load
from diffnet.kernels.calls import address, check, eager_only

LIBRARY = "winograd"


def kernels() -> ctypes.CDLL:
    """The loaded library with its functions' signatures (set once per load)."""
    return typed(load(LIBRARY))


@functools.cache
def typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, i32, p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.wino_weights.argtypes = [p, i64, i64, p]
    lib.wino_weights.restype = None
    lib.wino_forward.argtypes = [p, p, p, i64, i64, i64, i64, i64, p, i32]
    lib.wino_weight_grad.argtypes = [p, p, i64, i64, i64, i64, i64, p, i32]
    lib.wino_forward.restype = lib.wino_weight_grad.restype = i32
    return lib


def transformed(weight: torch.Tensor, data_grad: bool) -> torch.Tensor:
    """The kernel's transform U (16, ki, ko) of ``weight`` (cout, cin, 3, 3); for the data
    gradient, of the kernel rotated by 180 degrees with the channel axes swapped."""
    k = (weight.flip(2, 3).permute(2, 3, 0, 1) if data_grad
         else weight.permute(2, 3, 1, 0)).contiguous()
    u = torch.empty(16, k.shape[2], k.shape[3], dtype=torch.float32)
    kernels().wino_weights(address(k), k.shape[2], k.shape[3], address(u))
    return u


def convolve(x: torch.Tensor, u: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The 3x3 convolution (padding 1) of channels_last ``x`` with the transformed kernel u."""
    n, c, h, w = x.shape
    y = torch.empty(n, u.shape[2], h, w, dtype=torch.float32, memory_format=torch.channels_last)
    check(kernels().wino_forward(address(x), address(u), address(bias), n, h, w, c, u.shape[2],
                                 address(y), torch.get_num_threads()), "Winograd convolution")
    return y


class WinogradConv(torch.autograd.Function):
    """F.conv2d(x, weight, bias, padding=1) for the calls :func:`takes` accepts."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return convolve(x, transformed(weight.detach(), False),
                        None if bias is None else bias.detach().contiguous())

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        g = g.contiguous(memory_format=torch.channels_last)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = convolve(g, transformed(weight, True), None)
        if ctx.needs_input_grad[1]:
            n, c, h, w = x.shape
            gw = torch.empty(weight.shape, dtype=torch.float32)
            check(kernels().wino_weight_grad(address(x), address(g), n, h, w, c, weight.shape[0],
                                             address(gw), torch.get_num_threads()),
                  "Winograd convolution")
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g.sum((0, 2, 3))
        return gx, gw, gb


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel computes this call: a 4-D float32 channels_last field with even sides
    of at least 8 (the coarsest levels' few tiles run faster in oneDNN), both channel counts
    multiples of 16, and not traced, scripted, compiled or autocast."""
    return (x.dim() == 4 and x.dtype == weight.dtype == torch.float32
            and x.device.type == weight.device.type == "cpu"
            and x.is_contiguous(memory_format=torch.channels_last)
            and x.shape[1] % 16 == 0 and weight.shape[0] % 16 == 0
            and x.shape[2] % 2 == 0 and x.shape[3] % 2 == 0 and min(x.shape[2:]) >= 8
            and eager_only())


class WinogradConv2d(nn.Conv2d):
    """An ``nn.Conv2d`` (3x3, stride 1, padding 1) that runs the kernel where it applies
    (:func:`takes`) and oneDNN otherwise; the same parameters and state-dict keys."""

    def forward(self, x):
        if takes(x, self.weight):
            return WinogradConv.apply(x, self.weight, self.bias)
        return super().forward(x)


def fusable(m: nn.Module) -> bool:
    """A plain 3x3 ``nn.Conv2d`` with stride 1, zero padding 1, no dilation and no groups."""
    return (type(m) is nn.Conv2d and m.kernel_size == (3, 3) and m.stride == (1, 1)
            and m.padding == (1, 1) and m.dilation == (1, 1) and m.groups == 1
            and m.padding_mode == "zeros" and m.in_channels % 16 == 0
            and m.out_channels % 16 == 0)


def fuse_winograd(model: nn.Module) -> int:
    """Put the kernel in place of every fusable convolution of ``model``, in place; returns how
    many (0 again on a fused network). Loads (or builds) the kernel first, so a host that
    cannot build it raises :class:`diffnet.kernels.KernelUnavailable` before anything is
    changed."""
    kernels()
    fused = 0
    for m in model.modules():
        if fusable(m):
            m.__class__ = WinogradConv2d  # same object: parameters, hooks and keys stay
            fused += 1
    return fused
