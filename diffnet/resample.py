"""Resampling node fields between grids (resolution transfer of a trained generator).

Every grid in diffnet is a node grid that includes the boundary nodes, so two grids of the same
domain share their corner nodes: interpolation is bilinear (2-D grids) or trilinear (3-D grids)
with ``align_corners=True``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Interpolation mode by the number of grid axes (the tensor's dims after batch and channel).
MODES = {1: "linear", 2: "bilinear", 3: "trilinear"}


def resample_nodes(x: torch.Tensor, size) -> torch.Tensor:
    """x (B, C, H, W) or (B, C, D, H, W) on a node grid -> (B, C, *size) on the node grid of the
    same domain (``size`` has one entry per grid axis of x).

    Bilinear / trilinear (error O(h^2) on smooth fields, exact on fields linear in each axis, so
    Dirichlet values that are constant or linear along a wall or face stay exact). Point
    sampling, not averaging, when coarsening: the coarse nodes take the field's values there, as
    the problem's own ``build_input`` on the coarse grid would, with no blur of high-contrast
    fields such as nu.
    """
    size = tuple(int(v) for v in size)
    dims = x.dim() - 2
    if dims not in MODES or len(size) != dims:
        raise ValueError(f"resample_nodes: size {list(size)} must give one node count per grid "
                         f"axis of x {tuple(x.shape)} (B, C and 1 to 3 grid axes)")
    if tuple(x.shape[2:]) == size:
        return x
    return F.interpolate(x, size=size, mode=MODES[dims], align_corners=True)
