"""The problem checker's check of an answer head (:mod:`diffnet.problems.contract.heads`), one of the
checks of :mod:`diffnet.problems.check.problem`.

A head other than ``Plain`` is checked for what it needs of the problem (``head.check``: a
Ritz head needs a :class:`~diffnet.problems.contract.heads.QuadraticEnergy`) and for what training with
it assumes: a Ritz answer minimises the head's energy over the span of the imposed fields, and
training differentiates it at fixed coefficients, which is right only if that energy is the
loss. So the loss's directional derivative at the answer, along each imposed field (each lies
in the span, a partition's hats summing to one), must vanish. A quadratic form or load that
is not the loss's (a factor off, a term missing, a feature that is not linear) moves the answer
off the loss's minimiser and the derivative away from zero. That the head splits over blocks
is the split check's (it compares the answers).
"""
from __future__ import annotations

import torch

from diffnet.problems.check.methods import PROGRESS, Fault, Skipped, Subject, call, draw, expect, raw_field
from diffnet.problems.contract.heads import Plain

# Relative size of the loss's derivative along a field at the answer: the Ritz solve's shift
# (ritz.REG = 1e-7) leaves about that much; a wrong energy leaves O(0.1) or more.
STATIONARY_RTOL = 1e-5


def check_head(s: Subject) -> str:
    p = s.make()
    head = p.head
    if type(head) is Plain:
        raise Skipped("the Plain head: the answer is the imposed field")
    call(f"answer head {head!r}", head.check, p)
    p.set_progress(PROGRESS)
    _, x = draw(p, n=2)
    raw = raw_field(p, n=2).detach()
    fields = call("impose", p.impose, raw, x)
    u = call("answer", p.answer, raw, x).detach().requires_grad_()
    terms = call("loss_terms", p.loss_terms, u, x)
    loss = sum(t.sum() for k, t in terms.items() if k not in p.detached_terms)
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
        raise Fault("loss_terms", "terms that do not depend on the answer",
                    f"terms with a gradient, for head {head!r} to minimise")
    (grad,) = call("loss_terms (backward)", torch.autograd.grad, loss, u)
    along = (grad * fields).flatten(2)                              # (B, K, nodes)
    rel = along.sum(2).abs() / along.abs().sum(2).clamp_min(torch.finfo(along.dtype).tiny)
    worst = float(rel.max())
    expect(worst <= STATIONARY_RTOL, f"answer head {head!r}",
           f"an answer at which the loss still changes along an imposed field (derivative "
           f"{worst:.3g} of its scale)", f"the loss's minimiser over the fields' span "
           f"(derivative below {STATIONARY_RTOL:g}): the head's energy (quadratic_features, "
           f"load) must be the loss")
    return f"{head!r}: the answer is stationary for the loss along each field ({worst:.1e})"
