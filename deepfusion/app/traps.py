"""Known traps of a problem with a network, warned about once before training starts.

One so far: a network that normalises per sample (instance norm, as the U-Net does after its
first, bias-free convolution) removes every input channel's spatial mean. An input channel
that is spatially constant in every draw while its value changes from draw to draw (a number
of the draw written as a constant field, e.g. a constant flow's components) then reaches the
network only through the zero padding at the walls: the number is nearly lost, and the
network cannot learn how the answer depends on it. The fix is a field that carries the number
in its shape (a ramp whose slope is it, the number times a fixed field), and a problem marks
the channels it keeps for its loss and solver alone with the class attribute
``loss_only_channels`` (examples/families/README.md, "Inputs and instance norm").

Checked on the first training batch (at most ``DRAWS`` draws) on the first grid trained, by
rank 0, before the first step; it changes nothing a run computes.
"""
from __future__ import annotations

import torch

from diffnet.norms import InstanceNorm
from deepfusion.engine.parallel.data import ShardedPool

DRAWS = 16     # at most this many draws of the first batch are looked at
FLAT = 1e-9    # a channel is flat when its spatial spread is below this, relative to its size


def normalises_inputs(model: torch.nn.Module) -> bool:
    """Whether ``model`` normalises features per sample (instance norm)."""
    return any(isinstance(m, InstanceNorm) for m in model.modules())


def constant_channels(problem, seed: int, indices) -> list[str]:
    """The input channels of ``problem`` that are spatially constant in every draw of pool
    ``seed`` at ``indices`` and do not take one value in all of them (a number of the draw),
    its ``loss_only_channels`` left out. Needs two draws at least to tell; [] otherwise."""
    if len(indices) < 2:
        return []
    x = problem.build_input(problem.sample_params(seed, indices), dtype=torch.float64)
    flat = x.flatten(2)                                      # (n, C, nodes)
    size = flat.abs().amax(dim=2).clamp_min(1e-300)
    spread = flat.amax(dim=2) - flat.amin(dim=2)
    constant = (spread <= FLAT * size).all(dim=0)            # (C,): flat in every draw
    means = flat.mean(dim=2)                                 # (n, C)
    varies = (means.amax(dim=0) - means.amin(dim=0)) > FLAT * size.amax(dim=0)
    skip = set(getattr(problem, "loss_only_channels", ()) or ())
    return [c for i, c in enumerate(problem.input_channels)
            if constant[i] and varies[i] and c not in skip]


def instance_norm_warning(cfg, problem, model, rank: int = 0) -> str:
    """The warning for ``problem`` (on the first grid trained: the first batch) fed to
    ``model``, "" if there is nothing to say; looked at by rank 0 only ("" elsewhere)."""
    if rank != 0 or not normalises_inputs(model):
        return ""
    pool = ShardedPool(cfg.data.n_samples, cfg.data.global_batch, 0, 1, seed=cfg.data.seed)
    indices = pool.global_indices(0, 0)[:DRAWS]
    names = constant_channels(problem, cfg.data.seed, indices)
    if not names:
        return ""
    listed = ", ".join(repr(c) for c in names)
    one = len(names) == 1
    they, are, each = ("it", "is", "it") if one else ("they", "are", "each")
    return (f"input channel{'' if one else 's'} {listed} of problem {problem.name!r} {are} "
            f"constant in space in every draw of the first batch but differ{'s' if one else ''} "
            f"between draws, and model {cfg.model.name!r} normalises per sample (instance "
            f"norm), which removes a channel's spatial mean: the number{'' if one else 's'} "
            f"reach{'es' if one else ''} the network only through the zero padding at the "
            f"walls. Give the network a field that carries {each} (a ramp whose slope {they} "
            f"{are}, e.g. a constant flow b as b . (x - 1/2), or the number times a fixed "
            f"field); if {they} {are} for the loss and the reference solver only, say so in "
            f"the problem class: loss_only_channels = ({listed}{',' if one else ''}) "
            f"(docs/your-own-pde.md)")
