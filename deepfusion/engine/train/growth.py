"""The networks of a plan that grows its network (a level with ``prolong``): the stack of the
networks so far, innermost first, the visits that grew them and which of their parameters
train, and the network of any visit of the plan (:meth:`Networks.at`).

A growing visit has the application's ``grow`` wrap the network so far in a larger one, which
may freeze the network it wraps (``train_inner = false``); going back to before a growth (a
rollback, a resume) unwraps to a prefix of the stack and unfreezes what the growth froze.
Regrowing is deterministic, so a replayed trajectory is the same.
"""
from __future__ import annotations

import torch

from deepfusion.engine.train.plan import growths


class Networks:
    """The stack of grown networks of one training run, starting at ``module`` (``spec``: its
    generator spec); ``grow(module, visit) -> (grown module containing it, its spec)``."""

    def __init__(self, module: torch.nn.Module, spec: dict, grow=None):
        self.grow, self.stack, self.grown = grow, [(module, spec)], []
        self.trainable = [trainable(module)]  # per network on the stack

    def at(self, visits, index: int) -> tuple[torch.nn.Module, dict] | None:
        """(module, spec) of visit ``index`` of the plan ``visits``, grown at every growing
        visit up to it; None if the current network is that one already."""
        want = growths(visits, index)
        if want == self.grown:
            return None
        assert self.grow is not None, "a plan that grows the network needs a grow function"
        while self.grown and self.grown != want[:len(self.grown)]:
            self.grown.pop()
            self.stack.pop()
            self.trainable.pop()
        set_trainable(self.stack[-1][0], self.trainable[-1])
        for i in want[len(self.grown):]:
            self.stack.append(self.grow(self.stack[-1][0], visits[i]))
            self.trainable.append(trainable(self.stack[-1][0]))
            self.grown.append(i)
        return self.stack[-1]


def trainable(module: torch.nn.Module) -> list[bool]:
    """Which of ``module``'s parameters train (``requires_grad``), in order."""
    return [p.requires_grad for p in module.parameters()]


def set_trainable(module: torch.nn.Module, flags: list[bool]) -> None:
    """Make ``module``'s parameters train as ``flags`` (from :func:`trainable`) say."""
    for p, flag in zip(module.parameters(), flags):
        p.requires_grad_(flag)
