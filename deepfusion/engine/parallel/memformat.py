"""Memory formats: what ``model.channels_last = true`` means for 2-D and 3-D grids.

One flag, one format per tensor rank: 4-D tensors (B, C, H, W) of 2-D grids use
``torch.channels_last`` (NHWC), 5-D tensors (B, C, D, H, W) of 3-D grids
``torch.channels_last_3d`` (NDHWC). Everything else (biases, norms' 1-D weights, fields of
other ranks) keeps the default contiguous format. Every place that converts a model or an
input goes through :func:`convert_model` / :func:`as_format`, so no caller tests the rank.

Why channels-last in 3-D too: the float32 training step of the 3-D U-Net in NDHWC is faster
than in NCDHW for narrow networks and about as fast for wide ones, so the flag keeps its
meaning in 3-D (measured: lab/notes/readme-second-release.md, "Memory format").
"""
from __future__ import annotations

import torch

CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def memory_format(ndim: int, channels_last: bool = True) -> torch.memory_format:
    """The format of a tensor with ``ndim`` dimensions: channels-last (NHWC for 4-D, NDHWC
    for 5-D) if ``channels_last`` and there is one for that rank, else contiguous."""
    if not channels_last:
        return torch.contiguous_format
    return CHANNELS_LAST.get(int(ndim), torch.contiguous_format)


def as_format(x: torch.Tensor, channels_last: bool = True) -> torch.Tensor:
    """``x`` in the memory format of its rank (a no-op when it already is)."""
    return x.contiguous(memory_format=memory_format(x.dim(), channels_last))


def is_dense(t: torch.Tensor) -> bool:
    """The strides cover exactly numel() elements: contiguous, or channels-last of its rank."""
    fmt = memory_format(t.dim())
    return t.is_contiguous() or (fmt is not torch.contiguous_format
                                 and t.is_contiguous(memory_format=fmt))


def convolution_rank(model: torch.nn.Module) -> int:
    """The rank of the model's convolution weights (4: 2-D grids, 5: 3-D grids; 0: none)."""
    ranks = {p.dim() for p in model.parameters() if p.dim() in CHANNELS_LAST}
    if len(ranks) > 1:
        raise ValueError(f"model mixes {sorted(ranks)}-D convolution weights: no single "
                         f"channels-last format fits it; set model.channels_last = false")
    return ranks.pop() if ranks else 0


def convert_model(model: torch.nn.Module, channels_last: bool = True) -> torch.nn.Module:
    """``model`` with its convolution weights in the channels-last format of their rank (in
    place, returned); unchanged when ``channels_last`` is false."""
    rank = convolution_rank(model) if channels_last else 0
    return model.to(memory_format=CHANNELS_LAST[rank]) if rank else model
