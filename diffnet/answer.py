"""The answer a trained generator gives, as one torch module: the network, then the problem's
boundary imposition and answer head (``Problem.answer``).

Calling the network alone gives the wrong field for every problem that imposes its boundary
values or forms its answer from several output channels (Poisson's lift, Darcy's Ritz
combination), so everything that answers a user (``deepfusion infer``, ``deepfusion.load``,
``deepfusion export``) goes through this module.

>>> import torch
>>> from diffnet.generators import build_generator
>>> from diffnet.problems import get_problem
>>> problem = get_problem("poisson", grid=(16, 16))
>>> net = build_generator("unet", in_channels=2, depth=2, base_width=4)
>>> x = problem.build_input(problem.sample_params(0, range(3)))
>>> Answer(net, problem)(x).shape
torch.Size([3, 1, 16, 16])
"""
from __future__ import annotations

import torch


class Answer(torch.nn.Module):
    """``problem.answer(model(x), x)``: input fields (B, C, *grid) -> the solution field
    (B, 1, *grid) on the problem's grid (its block, under a domain split).

    ``problem`` is held as a plain attribute, not a submodule: it has no parameters, and its
    state (masks, the answer head's basis) is rebuilt from its options, not saved with the
    network's weights.
    """

    def __init__(self, model: torch.nn.Module, problem):
        super().__init__()
        self.model = model
        self.problem = problem

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.problem.answer(self.model(x), x)
