"""A plugin whose draw's first amplitude also reaches the network as a constant field: the trap
``train`` warns about with instance norm (tests/test_traps.py), and the same family marking that
channel as the loss's only (``loss_only_channels``), which does not warn."""
from __future__ import annotations

import numpy as np
import torch

from examples.heat import Heat

__all__ = ["ConstantInput", "ConstantInputMarked"]


class ConstantInput(Heat):
    """The family of ``Heat`` with a second input channel "a_1", the draw's first amplitude as
    a constant field (the loss reads only the source "f").

    ``amplitude_range`` is the interval both amplitudes are drawn from (default (0.5, 1.5)).
    """

    name = "constant_input"
    input_channels = ("f", "a_1")

    def build_input(self, params, dtype=torch.float32) -> torch.Tensor:
        f = super().build_input(params, dtype)
        a = torch.as_tensor(np.asarray(params)[:, 0], dtype=dtype)
        return torch.cat([f, a[:, None, None, None].expand_as(f)], dim=1)


class ConstantInputMarked(ConstantInput):
    """``ConstantInput`` saying its "a_1" is for the loss only: no warning.

    ``amplitude_range`` is the interval both amplitudes are drawn from (default (0.5, 1.5)).
    """

    name = "constant_input_marked"
    loss_only_channels = ("a_1",)
