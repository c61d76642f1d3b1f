"""Resampling node fields between grids (resolution transfer of a trained generator).

Every grid in diffnet is a node grid that includes the boundary nodes, so two grids of the same
domain share their corner nodes: interpolation is bilinear with ``align_corners=True``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def resample_nodes(x: torch.Tensor, size) -> torch.Tensor:
    """x (B, C, H, W) on a node grid -> (B, C, *size) on the node grid of the same domain.

    Bilinear (error O(h^2) on smooth fields, exact on fields linear in each axis, so Dirichlet
    values that are constant or linear along a wall stay exact). Point sampling, not averaging,
    when coarsening: the coarse nodes take the field's values there, as the problem's own
    ``build_input`` on the coarse grid would, with no blur of high-contrast fields such as nu.
    """
    size = tuple(int(v) for v in size)
    if tuple(x.shape[-2:]) == size:
        return x
    return F.interpolate(x, size=size, mode="bilinear", align_corners=True)
