"""Compiled kernels for the training step, built from C source at first use (``build``): the
instance norm + GELU pair of the U-Nets as one kernel (``norm_gelu``), the decoder's bilinear
upsampling + skip concatenation as another (``upcat``), and the 3x3 stride-1 convolutions by
Winograd's algorithm (``winograd``).

They are optional: ``train.fused_kernels`` is off by default, and the eager modules compute the
same function (to float32 rounding). ``fuse(model)`` puts every kernel into a built network;
the engine calls it when ``train.fused_kernels`` is set (and refuses a host without GCC).

>>> import torch
>>> from diffnet.generators import UNet
>>> from diffnet.kernels import fuse
>>> net = UNet(in_channels=1, depth=2).to(memory_format=torch.channels_last)
>>> fuse(net)
{'norm_gelu': 10, 'upcat': 2, 'winograd': 9}
>>> x = torch.rand(2, 1, 16, 16).contiguous(memory_format=torch.channels_last)
>>> net(x).shape
torch.Size([2, 1, 16, 16])
"""
from __future__ import annotations

from torch import nn

from diffnet.kernels import norm_gelu, upcat, winograd
from diffnet.kernels.build import KernelUnavailable, describe
from diffnet.kernels.norm_gelu import FusedNormGELU, NormGELU, fuse_norm_gelu
from diffnet.kernels.upcat import FusedUp, UpsampleCat, fuse_upsample_cat
from diffnet.kernels.winograd import WinogradConv, WinogradConv2d, fuse_winograd

# library name -> (what it fuses, its loader, the function that fuses it, the fused module,
# whether a module of an unfused network is one it would take)
KERNELS = {
    norm_gelu.LIBRARY: ("instance norm + GELU pair(s)", norm_gelu.kernels, fuse_norm_gelu,
                        FusedNormGELU, norm_gelu.fusable),
    upcat.LIBRARY: ("bilinear upsampling + skip concatenation(s)", upcat.kernels,
                    fuse_upsample_cat, FusedUp, upcat.fusable),
    winograd.LIBRARY: ("3x3 convolution(s) by Winograd F(2x2, 3x3)", winograd.kernels,
                       fuse_winograd, WinogradConv2d, winograd.fusable),
}


def fuse(model: nn.Module) -> dict[str, int]:
    """Every kernel into ``model``, in place: {library: how many places it took}. All the
    libraries are loaded (or built) first, so a host that cannot build one raises
    :class:`KernelUnavailable` before anything is changed."""
    for _, load, *_ in KERNELS.values():
        load()
    return {name: fn(model) for name, (_, _, fn, *_) in KERNELS.items()}


def fusable(model: nn.Module) -> bool:
    """Whether :func:`fuse` would put any kernel into ``model`` (nothing is built or changed)."""
    return any(takes(m) for *_, takes in KERNELS.values() for m in model.modules())


def counts(model: nn.Module) -> dict[str, int]:
    """{library: how many of ``model``'s modules run it} (all 0 on an unfused network)."""
    return {name: sum(isinstance(m, module) for m in model.modules())
            for name, (_, _, _, module, _) in KERNELS.items()}


def summary(model: nn.Module) -> str:
    """The start-up line's account of a fused ``model``: what each kernel took and from
    which library."""
    return "; ".join(f"{n} {KERNELS[name][0]} from {describe(name)}"
                     for name, n in counts(model).items())


__all__ = ["KERNELS", "KernelUnavailable", "FusedNormGELU", "FusedUp", "NormGELU",
           "UpsampleCat", "WinogradConv", "WinogradConv2d", "counts", "describe", "fusable", "fuse",
           "fuse_norm_gelu", "fuse_upsample_cat", "fuse_winograd", "summary"]
