"""The U-Net decoder's bilinear x2 upsampling and skip concatenation as one compiled kernel
(``upcat.c``), and :func:`fuse_upsample_cat`, which puts it into a built network.

Eager PyTorch writes the upsampled field, reads it back into ``torch.cat``, and in backward
copies the concatenation's gradient slice dense before upsampling's backward reads it
(:class:`diffnet.generators.DenseGrad`). The kernel writes the concatenation straight from the
coarse field and the skip, and in backward reads the concatenation's gradient once. Its
arithmetic is ATen's (``upcat.c``), so it agrees with the eager modules to float32 rounding
(bit for bit where ATen's kernel runs the same fused multiply-adds; tested). It takes 4-D
float32 channels_last fields, the training step's; anything else runs the eager module.
"""
from __future__ import annotations

import ctypes
import functools

import torch
from torch import nn

from diffnet.generators import Up
from diffnet.kernels.build import load
from diffnet.kernels.calls import address, check, eager_only

LIBRARY = "upcat"


def kernels() -> ctypes.CDLL:
    """The loaded library with its functions' signatures (set once per load)."""
    return typed(load(LIBRARY))


@functools.cache
def typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, i32, p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.upcat_forward.argtypes = [p, p, i64, i64, i64, i64, i64, p, i32]
    lib.upcat_backward.argtypes = [p, i64, i64, i64, i64, i64, p, p, i32]
    lib.upcat_forward.restype = lib.upcat_backward.restype = i32
    return lib


def channels_last(t: torch.Tensor) -> bool:
    return t.is_contiguous(memory_format=torch.channels_last)


class UpsampleCat(torch.autograd.Function):
    """cat([bilinear x2 upsampling of x (align_corners=False), skip], dim=1) for float32
    channels_last (B, Cu, h, w) ``x`` and (B, Cs, 2h, 2w) ``skip``."""

    @staticmethod
    def forward(ctx, x, skip):
        b, cu, h, w = x.shape
        cs = skip.shape[1]
        out = torch.empty(b, cu + cs, 2 * h, 2 * w, dtype=x.dtype, memory_format=torch.channels_last)
        kernels().upcat_forward(address(x), address(skip), b, h, w, cu, cs, address(out),
                                torch.get_num_threads())
        ctx.shapes = (b, h, w, cu, cs)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        b, h, w, cu, cs = ctx.shapes
        g = g.contiguous(memory_format=torch.channels_last)
        gx = gskip = None
        if ctx.needs_input_grad[0]:
            gx = torch.empty(b, cu, h, w, dtype=g.dtype, memory_format=torch.channels_last)
        if ctx.needs_input_grad[1]:
            gskip = torch.empty(b, cs, 2 * h, 2 * w, dtype=g.dtype,
                                memory_format=torch.channels_last)
        check(kernels().upcat_backward(address(g), b, h, w, cu, cs, address(gx),
                                       address(gskip), torch.get_num_threads()),
              "upsampling + concatenation")
        return gx, gskip


def takes(x: torch.Tensor, skip: torch.Tensor) -> bool:
    """Whether the kernel computes this call: 4-D float32 channels_last fields, the skip
    twice the resolution of ``x``, and not traced, scripted, compiled or autocast."""
    return (x.dim() == 4 and skip.dim() == 4 and x.dtype == skip.dtype == torch.float32
            and x.device.type == skip.device.type == "cpu"
            and channels_last(x) and channels_last(skip)
            and skip.shape[0] == x.shape[0]
            and tuple(skip.shape[2:]) == (2 * x.shape[2], 2 * x.shape[3])
            and eager_only())


class FusedUp(Up):
    """An :class:`diffnet.generators.Up` with bilinear upsampling whose merge (upsampling and
    concatenation) runs as the kernel where it applies (:func:`takes`), as the eager module's
    otherwise. It holds the same submodules (the same state-dict keys)."""

    def __init__(self, up: Up):
        nn.Module.__init__(self)
        self.up, self.block = up.up, up.block

    def merge(self, x, skip):
        if takes(x, skip):
            return UpsampleCat.apply(x, skip)
        return super().merge(x, skip)


def fusable(m: nn.Module) -> bool:
    """A 2-D Up with parameter-free bilinear x2 upsampling (align_corners=False)."""
    up = getattr(m, "up", None)
    return (type(m) is Up and isinstance(up, nn.Upsample) and up.mode == "bilinear"
            and up.scale_factor in (2, 2.0, (2.0, 2.0)) and not up.align_corners)


def fuse_upsample_cat(model: nn.Module) -> int:
    """Put the compiled kernel in place of every bilinear :class:`Up` of ``model``, in place;
    returns how many (0 again on a fused network). Loads (or builds) the kernel first, so a
    host that cannot build it raises :class:`diffnet.kernels.KernelUnavailable` before
    anything is changed."""
    kernels()
    fused = 0
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if fusable(child):
                setattr(parent, name, FusedUp(child))
                fused += 1
    return fused
