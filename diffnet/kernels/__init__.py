"""Compiled kernels for the training step, built from C source at first use (``build``): the
instance norm + GELU pair of the U-Nets as one kernel (``norm_gelu``).

They are optional: ``train.fused_kernels`` is off by default, and the eager modules compute the
same function. ``fuse_norm_gelu(model)`` puts the kernel into a built network; the engine calls
it when ``train.fused_kernels`` is set (and refuses a host without GCC).

>>> import torch
>>> from diffnet.generators import UNet
>>> from diffnet.kernels import fuse_norm_gelu
>>> net = UNet(in_channels=1, depth=2).to(memory_format=torch.channels_last)
>>> fuse_norm_gelu(net)
10
>>> x = torch.rand(2, 1, 16, 16).contiguous(memory_format=torch.channels_last)
>>> net(x).shape
torch.Size([2, 1, 16, 16])
"""
from diffnet.kernels.build import KernelUnavailable, describe
from diffnet.kernels.norm_gelu import LIBRARY, FusedNormGELU, NormGELU, fuse_norm_gelu

__all__ = ["KernelUnavailable", "FusedNormGELU", "NormGELU", "fuse_norm_gelu", "describe",
           "LIBRARY"]
