"""The instance norm + exact GELU pair as one compiled kernel (``norm_gelu.c``), and
:func:`fuse_norm_gelu`, which puts it into a built network.

Eager PyTorch runs the pair as about ten passes over each activation (the norm's sums, its
affine map, the GELU; more in backward); the kernel makes two forward and two backward, and
keeps only the norm's input for backward. It takes 4-D float32 channels_last activations, the
training step's; anything else (bf16 under autocast, NCHW, 3-D grids, tracing for export)
runs the eager modules unchanged, so a fused network computes the same function everywhere.
The kernel's sums are in double over fixed blocks of rows, so its results do not depend on the
thread count; they differ from the eager pair's by float32 rounding.
"""
from __future__ import annotations

import ctypes
import functools

import torch
from torch import nn

from diffnet.kernels.build import load
from diffnet.kernels.calls import address, check, eager_only
from diffnet.norms import InstanceNorm

LIBRARY = "norm_gelu"
KERNEL = "fused norm + GELU"  # in error messages


def kernels() -> ctypes.CDLL:
    """The loaded library with its functions' signatures (set once per load)."""
    return typed(load(LIBRARY))


@functools.cache
def typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    f, i64, i32, p = ctypes.c_float, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.norm_gelu_forward.argtypes = [p, p, p, f, i64, i64, i64, p, p, p, i32]
    lib.norm_gelu_backward.argtypes = [p, p, p, p, p, p, i64, i64, i64, p, p, p, i32]
    lib.norm_gelu_forward.restype = lib.norm_gelu_backward.restype = i32
    return lib


class NormGELU(torch.autograd.Function):
    """gelu(instance_norm(x) * weight + bias) for float32 channels_last (B, C, H, W) ``x``."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        b, c, h, w = x.shape
        y = torch.empty_like(x)
        m1, rstd = x.new_empty(b, c), x.new_empty(b, c)
        weight, bias = weight.contiguous(), bias.contiguous()
        check(kernels().norm_gelu_forward(
            address(x), address(weight), address(bias), eps, b, h * w, c,
            address(y), address(m1), address(rstd), torch.get_num_threads()), KERNEL)
        ctx.save_for_backward(x, weight, bias, m1, rstd)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        x, weight, bias, m1, rstd = ctx.saved_tensors
        b, c, h, w = x.shape
        g = g.contiguous(memory_format=torch.channels_last)
        gx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        gw, gb = weight.new_empty(c), bias.new_empty(c)
        check(kernels().norm_gelu_backward(
            address(x), address(g), address(weight), address(bias), address(m1),
            address(rstd), b, h * w, c, address(gx), address(gw), address(gb),
            torch.get_num_threads()), KERNEL)
        return (gx, gw if ctx.needs_input_grad[1] else None,
                gb if ctx.needs_input_grad[2] else None, None)


def takes(x: torch.Tensor, norm: nn.Module) -> bool:
    """Whether the kernel computes this call: 4-D float32 channels_last input and parameters,
    not traced, scripted or compiled (those see the eager modules)."""
    return (x.dim() == 4 and x.dtype == torch.float32 and x.device.type == "cpu"
            and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
            and norm.weight.dtype == torch.float32 and eager_only())


class FusedNormGELU(InstanceNorm):
    """An InstanceNorm and the nn.GELU after it as one module: the kernel where it applies
    (:func:`takes`), the two modules' functions otherwise. It stands in the norm's place with
    the norm's own parameters (the same state-dict keys); the GELU's place holds an
    ``nn.Identity``."""

    def __init__(self, norm: InstanceNorm, act: nn.GELU):
        nn.Module.__init__(self)
        self.num_features, self.eps = norm.num_features, norm.eps
        self.weight, self.bias = norm.weight, norm.bias
        self.act = act

    def forward(self, x):
        if takes(x, self):
            return NormGELU.apply(x, self.weight, self.bias, self.eps)
        return self.act(super().forward(x))


def pairs(seq: nn.Sequential) -> list[int]:
    """Indices i of ``seq`` where an InstanceNorm is followed by an exact nn.GELU."""
    kids = list(seq)
    return [i for i in range(len(kids) - 1)
            if type(kids[i]) is InstanceNorm and type(kids[i + 1]) is nn.GELU
            and kids[i + 1].approximate == "none"]


def fusable(m: nn.Module) -> bool:
    """An nn.Sequential holding at least one (InstanceNorm, exact GELU) pair."""
    return isinstance(m, nn.Sequential) and bool(pairs(m))


def fuse_norm_gelu(model: nn.Module) -> int:
    """Put the compiled kernel in place of every (InstanceNorm, exact GELU) pair of ``model``'s
    nn.Sequential blocks, in place; returns the number of pairs fused (0 again on a fused
    network). Loads (or builds) the kernel first, so a host that cannot build it raises
    :class:`diffnet.kernels.KernelUnavailable` here, before anything is changed. The state dict
    keeps its keys, so checkpoints load into fused and unfused networks alike.
    """
    kernels()
    fused = 0
    for seq in [m for m in model.modules() if isinstance(m, nn.Sequential)]:
        for i in pairs(seq):
            seq[i] = FusedNormGELU(seq[i], seq[i + 1])
            seq[i + 1] = nn.Identity()
            fused += 1
    return fused
