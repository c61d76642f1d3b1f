"""The answer residual every problem has without code of its own, derived from its training
loss (``Problem.answer_residual`` of a family that defines none: :func:`loss_residual`).

For answers u to inputs x, with L the problem's training loss (the sum of its ``loss_terms``,
as the trainer sums them) and g(u) = dL/du at the nodes ``impose`` leaves free::

    loss_residual(u) = ||g(u)||_B / ||g(u_lift)||_B,     u_lift = impose(0, x)

per sample, in float64 on the whole grid. The discrete solution minimises L over the fields
``impose`` makes admissible, so g vanishes there and the number is 0 (to rounding) for any
loss: an energy, a squared residual, a multilevel norm; the lift (the network's output 0)
reads 1. It needs no reference solver and no code of the family's.

Choices, and why:

* **The free nodes, not the network's output v.** The answer is u = impose(v, x); the trainer
  descends dL/dv = J^T dL/du, J = d impose / dv. Every problem imposes node by node (the loss
  contract, :mod:`.loss`) and affinely in v (a lift plus a factor times v), so J is a diagonal
  that does not depend on v, and its non-zero entries mark the nodes the network can move.
  g = dL/du on those nodes (0 on the others) has the same zeros as dL/dv but not its weights:
  a bubble factor (Poisson's ``bc_mode = "lift"``, the example families) would shrink the
  residual next to a wall by a factor of order h, an ``output_scale`` would scale it, and
  neither says how far the answer is from the solution. It also needs no v: the answer
  given (from a file, interpolated from another grid, a Ritz head's combination of several
  fields, which is again an admissible field) is checked as it is, and boundary values it
  gets wrong show in the residual of the free nodes next to them.
* **The multilevel norm** (``residual_norm``, the H^-1-like BPX norm, its interior=0: the
  free nodes of a Neumann wall count) rather than the nodal one. g is a residual at the
  nodes: for an energy loss g = h^d (A u - f), whose nodal norm weighs an error of wavelength
  l by (L / l)^2 more when l is the grid spacing than when l is the domain (network answers
  are rough at the grid scale: the nodal residual of a 1%-accurate answer can exceed the
  lift's). In the H^-1 norm ||g||_B is equivalent to the energy norm of the error, the
  quantity the energy's minimiser is best in, for an energy loss or a loss in this norm
  (g = A^T B r, B ~ A^-1, is then a residual again); for the plain
  squared residual (g = A^T r, one more operator) roughness still weighs more, and the
  threshold calibrated on the model's own validation answers
  (``deepfusion.engine.predict.calibration``) accounts for how much. The same norm on
  every grid, dimension and split; subdomain sums (:mod:`.answer_check`) would need a choice
  of subdomains per problem.
* **The loss at the end of training**: a loss with a schedule (``set_progress``) is read at
  progress 1, on a private copy of the problem on the whole grid (``config()`` rebuilds it),
  so neither the caller's problem (its block, its progress, its cached tensors, which may be
  inference tensors) nor its loss is touched.

A non-finite answer reads NaN (the check flags it); where the lift itself solves the problem
(g(u_lift) = 0) an answer reads 0 if it does too, else inf.
"""
from __future__ import annotations

import weakref

import numpy as np
import torch

from diffnet.problems.contract.answer_check import answers_and_inputs
from diffnet.problems.contract.residual_norm import residual_norm

# problem -> its private whole-grid copy at progress 1 (built once per problem object)
_COPIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def whole_copy(problem):
    """``problem`` rebuilt from its ``config()`` on the whole grid, its loss at progress 1."""
    try:
        return _COPIES[problem]
    except (KeyError, TypeError):
        pass
    copy = type(problem)(**problem.config())
    copy.set_progress(1.0)
    try:
        _COPIES[problem] = copy
    except TypeError:   # an object that cannot be weakly referenced: rebuilt per call
        pass
    return copy


def free_nodes(problem, inputs: torch.Tensor) -> torch.Tensor:
    """(B, 1, *grid) 1.0 at the nodes ``impose`` lets the network move (d impose / dv != 0 at
    v = 0), 0.0 where it fixes the value; and the lift impose(0, x) (B, 1, *grid)."""
    v = torch.zeros(len(inputs), problem.output_channels, *problem.grid, dtype=torch.float64,
                    requires_grad=True)
    lift = problem.impose(v, inputs)[:, :1]
    if not lift.requires_grad:           # impose ignores the network: nothing is free
        return torch.zeros_like(lift), lift.detach()
    (slope,) = torch.autograd.grad(lift.sum(), v, allow_unused=True)
    slope = torch.zeros_like(lift) if slope is None else slope[:, :1]
    return (slope != 0).to(torch.float64), lift.detach()


def loss_gradient(problem, u: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """(B, 1, *grid) dL/du of each sample's training loss (the sum of its terms)."""
    u = u.detach().requires_grad_(True)
    terms = problem.loss_terms(u, inputs)
    total = sum(t.sum() for t in terms.values())
    (g,) = torch.autograd.grad(total, u, allow_unused=True)
    return torch.zeros_like(u) if g is None else g


def loss_residual(problem, u, inputs) -> np.ndarray:
    """(B,) float64 ||g(u)||_B / ||g(u_lift)||_B of answers u (B, *grid) or (B, 1, *grid) to
    inputs (B, C, *grid), numpy or torch, on ``problem``'s whole grid (module docstring)."""
    u, x = answers_and_inputs(problem, u, inputs)
    # autograd even where the caller predicts under inference mode or no_grad; the tensors
    # made here (and the copy's) are ordinary ones
    with torch.inference_mode(False), torch.enable_grad():
        p = whole_copy(problem)
        xt = torch.from_numpy(x)
        finite = np.isfinite(u.reshape(len(u), -1)).all(axis=1)
        free, lift = free_nodes(p, xt)
        # a non-finite answer is replaced by the lift here (its number is NaN below), so it
        # cannot reach another sample through any batch-wide operation of a loss
        ut = torch.where(torch.from_numpy(finite).view(-1, *(1,) * (u.ndim)),
                         torch.from_numpy(np.nan_to_num(u))[:, None], lift)
        g = loss_gradient(p, torch.cat([ut, lift]), torch.cat([xt, xt])) * torch.cat([free, free])
        norms = residual_norm(g.detach(), p, interior=0).clamp_min(0).sqrt().numpy()
    answer, zero = norms[:len(u)], norms[len(u):]
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(zero > 0, answer / np.where(zero > 0, zero, 1.0),
                       np.where(answer > 0, np.inf, 0.0))
    return np.where(finite, out, np.nan)
