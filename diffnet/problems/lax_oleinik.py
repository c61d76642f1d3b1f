"""Polishing an answer with the Lax-Oleinik functional: per-node descent from a given field.

The entropy solution of u_t + (u^2/2)_x = 0 minimises, at every node (x, t > 0) separately,

    g(u) = (U0(x - u t) - U0(x)) / t + u^2 / 2,      U0(y) = int_0^y u0,

(Evans, PDE, 3.4.2; the Burgers problem's "lax-oleinik" loss). g is one-dimensional and its
derivatives are closed-form: g'(u) = u - u0(x - u t) (the characteristic equation) and
g''(u) = 1 + t u0'(x - u t). Away from shocks g is convex near its minimum; behind a shock it
has two local minima, the deeper one the solution. ``polish`` starts at a given field (a
network's answer) and takes safeguarded Newton steps at every node: Newton where g'' > 0, a
gradient step elsewhere, each halved until g does not increase. It converges to the minimum of
the basin the node starts in: it sharpens a smeared shock and removes the smooth error, but a
node that starts in the wrong basin stays there (the shock stays where the network put it, to
a node). It is therefore not a solver: which basin, i.e. where the shocks are, is the
network's answer. It cannot make the answer worse in g: no node's g ever increases.

The loss has no gradient through a polished answer (it is a minimiser of the loss), so it is
for answering, not training.
"""
from __future__ import annotations

import torch

from ..primitive import primitive_at, primitive_derivatives_at

# A Newton step only where g'' is safely positive; elsewhere the gradient step.
CONVEX = 1e-3
HALVINGS = 12
TINY = 1e-7      # in u (O(1) values): below float32 resolution, and rounding in g decides


def polish(u: torch.Tensor, u0_row: torch.Tensor, big_u0: torch.Tensor, here: torch.Tensor,
           x: torch.Tensor, t: torch.Tensor, dx: float, iters: int) -> torch.Tensor:
    """(B, h, w) the nodes' values after ``iters`` safeguarded Newton steps on g.

    u (B, h, w): the starting values at nodes with t > 0; u0_row, big_u0 (B, W): u0 and U0 on
    the whole row of nodes; here (B, 1, w): U0 at the nodes' x; x (w,) and t (h, 1): the nodes'
    coordinates."""
    def value(v, idx=None):
        """g at values v of every node, or of the nodes idx (index tensors of a subset)."""
        if idx is None:
            return (primitive_at(big_u0, u0_row, dx, x - v * t) - here) / t + 0.5 * v * v
        tt = t.expand_as(u)[idx]
        y = x.expand_as(u)[idx] - v * tt
        return ((primitive_at(big_u0, u0_row, dx, y, rows=idx[0]) - here.expand_as(u)[idx])
                / tt + 0.5 * v * v)

    for _ in range(iters):
        val, d1, d2 = primitive_derivatives_at(big_u0, u0_row, dx, x - u * t)
        g, g1, g2 = (val - here) / t + 0.5 * u * u, u - d1, 1 + t * d2
        step = torch.where(g2 > CONVEX, g1 / g2.clamp_min(CONVEX), g1)
        better = value(u - step) <= g                      # the full step, at every node
        u = torch.where(better, u - step, u)
        # halvings where it was refused (a few nodes near the shocks), on those nodes only;
        # a node is done when a step is accepted or too small to matter (rounding in g could
        # refuse it forever)
        todo = ~better & (step.abs() >= TINY)
        for _ in range(HALVINGS):
            idx = todo.nonzero(as_tuple=True)
            if not len(idx[0]):
                break
            step = torch.where(todo, 0.5 * step, step)
            cand = u[idx] - step[idx]
            ok = value(cand, idx) <= g[idx]
            u[idx] = torch.where(ok, cand, u[idx])
            todo[idx] = ~ok & (step[idx].abs() >= TINY)
    return u
