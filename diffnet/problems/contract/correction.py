"""The coarse correction of an answer: the minimiser of the problem's own training loss over
the answer's local rescalings and a coarse finite-element space on a coarse partition, for any
linear PDE with a quadratic loss (``coarse_correction``; the engine's ``problem.correction``).

For an answer u with boundary lift g (``impose`` of the zero output) and v = u - g on the
nodes ``impose`` leaves free, the corrected answer is

    u + sum_a (c_a phi_a v + e_a phi_a),     (c, e) = argmin L(u + ...),

phi_a the (m + 1)^d tensor-product hats of an m^d coarse partition (bilinear / trilinear in the
node index, a partition of unity), taken on the free nodes. This is the partition-of-unity
(generalised finite-element) method of Melenk and Babuska (1996) with the local space
{v, 1} on every patch: the network's answer gives the shape at the scales a coarse cell cannot
resolve, the coarse hats the smooth error the network leaves, and the equation sets both
amplitudes region by region. The span holds v, so the loss can only fall. Neither part alone
does it: the network's error is mostly smooth (what gradient descent on a PDE loss fits last),
the coarse space alone misses everything below a cell. For an energy (or ``residual_energy``)
the answer is the best in the energy norm over the span; for a residual norm the best in that
norm. It generalises the Ritz head's partition (:mod:`.ritz`) to any problem, from its loss
alone.

Why the loss, not the PDE: every problem has one and nothing else is needed of it. With L
quadratic in u its gradient is affine, g(u + w) = g(u) + H w, so the system G d = -b over the
2J fields f_i (the phi_a v, then the phi_a) is assembled from gradients alone (autograd through
the loss, float64, the whole grid): G_ij = f_i . H f_j and b_i = f_i . g(u), 2J + 1 gradients,
J = (m + 1)^d, per answer. A non-linear PDE or loss (Burgers' Lax-Oleinik functional) has no
such G: a probe (g(u + 2w) - g(u) against twice g(u + w) - g(u)) refuses it, naming the
problem.

Cost: where the loss's Hessian reaches only a node's 3^d neighbours (an energy or
``residual_energy`` of a 3^d stencil) and every coarse cell is at least two nodes wide,
H f_j meets only the fields of the hats next to j's, so each kind of field is summed in 3^d
colour classes (hat index mod 3 per axis), one gradient per class, and each product
f_i . H (sum of a class) is the one G_ij of i's neighbour j in that class: 18 gradients in 2-D,
54 in 3-D, whatever m. The Hessian of a loss is symmetric, and a Hessian that reaches farther
(a multilevel norm, a squared residual) mixes the neighbours of a class into a non-symmetric
G, so a G that is not symmetric to rounding falls back to the 2J gradients (remembered for the
problem). It runs on the whole grid of one process. The fields are never all stored: each hat
is a product of 1-D hats, so the products f_i . h of every field with a field h are one
contraction per axis (``contract_hats``), the correction a prolongation of the coefficients
(``expand_hats``), and fields are built only for the gradients, ``NODES_PER_PASS`` at a time.

>>> import torch
>>> from diffnet.problems import get_problem, coarse_correction
>>> p = get_problem("poisson", grid=(17, 17))
>>> x = p.build_input(p.sample_params(0, range(2)), torch.float64)
>>> u = p.answer(0.1 * torch.randn(2, 1, 17, 17, dtype=torch.float64), x)
>>> fixed = coarse_correction(p, u, x, cells=4)
>>> loss = lambda w: sum(p.loss_terms(w, x).values())
>>> bool((loss(fixed) <= loss(u)).all())
True
"""
from __future__ import annotations

import itertools
import weakref

import numpy as np
import torch

from diffnet.problems.contract.loss_residual import free_nodes, loss_gradient, whole_copy
from diffnet.problems.contract.ritz import coarse_lines, line_hats, solve_gram
from diffnet.validation import check_int

# relative departure from an affine gradient above which the loss is taken as non-quadratic:
# float64 rounding of a gradient sums ~1e-13; a non-linear loss departs at order one
AFFINE_RTOL = 1e-6
# relative asymmetry of a coloured G above which the Hessian is taken to reach beyond a
# node's neighbours (rounding: ~1e-13)
SYMMETRY_RTOL = 1e-8
# the nodes one gradient pass of the correction takes (fields x grid nodes): its memory, not
# its speed, sets it (a 3-D loss's autograd graph holds several copies of every field)
NODES_PER_PASS = 2 ** 21
# the whole-grid problems whose Hessian was found to reach farther: J gradients from then on
WIDE_HESSIANS: "weakref.WeakSet" = weakref.WeakSet()
# problem -> the cells ``check_correction`` has passed for it (checked once per problem)
CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def hat_lines(grid, cells: int) -> list:
    """Per axis of ``grid`` the (cells + 1, n) float64 1-D hats whose tensor products are the
    hats of a ``cells``^d coarse partition (``cells`` 0: one row of ones, the constant)."""
    return [line_hats(n, coarse_lines(n, cells)) if cells else
            torch.ones(1, n, dtype=torch.float64) for n in grid]


def contract_hats(w: torch.Tensor, lines) -> torch.Tensor:
    """(B, *(cells + 1,) * d) the products sum_nodes phi_a w of fields w (B, *grid) with every
    hat phi_a of the partition ``lines``: one 1-D contraction per axis."""
    for line in lines:
        w = torch.tensordot(w, line, dims=([1], [1]))      # axis 1 contracted, hat axis last
    return w


def expand_hats(c: torch.Tensor, lines) -> torch.Tensor:
    """(B, *grid) the fields sum_a c_a phi_a for coefficients c (B, *(cells + 1,) * d)."""
    for line in lines:
        c = torch.tensordot(c, line, dims=([1], [0]))      # hat axis 1 expanded, node axis last
    return c


def partition_hats(grid, cells: int) -> torch.Tensor:
    """(J, *grid) float64 tensor-product hats of a ``cells``^d coarse partition of ``grid``
    (J = (cells + 1)^d), summing to one at every node; ``cells`` 0: the one constant field."""
    lines = hat_lines(grid, cells)
    sizes = [len(line) for line in lines]
    j = int(np.prod(sizes))
    return expand_hats(torch.eye(j, dtype=torch.float64).view(j, *sizes), lines)


def check_cells(cells, grid) -> int:
    """``cells`` as an int in 0 .. min(grid) - 1; ValueError naming the fix otherwise."""
    cells = check_int("the coarse correction's cells", cells, 0)
    if cells > min(grid) - 1:
        raise ValueError(f"the coarse correction's cells = {cells} needs at least {cells + 1} "
                         f"nodes per axis, the grid is {list(grid)}: use at most "
                         f"{min(grid) - 1}")
    return cells


def check_correction(problem, cells) -> int:
    """``cells`` checked for ``problem`` before any answer needs it: its range on the grid,
    then the correction of one answer to a draw of the family (an imposed random output),
    which refuses a loss that is not quadratic. ValueError naming the fix; ``cells`` as an int
    (0: nothing to check)."""
    cells = check_cells(cells, problem.grid)
    if cells and cells not in CHECKED.setdefault(problem, set()):
        x = problem.build_input(problem.sample_params(0, range(1)), torch.float64)
        raw = torch.randn(1, problem.output_channels, *problem.grid, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            u = problem.answer(0.1 * raw, x)
        coarse_correction(problem, u, x, cells)
        CHECKED[problem].add(cells)
    return cells


def coarse_correction(problem, u, inputs, cells: int, *, fields_per_pass: int | None = None):
    """(B, 1, *grid) the answers ``u`` (B, 1, *grid) to ``inputs`` (B, C, *grid) corrected by
    the minimiser of ``problem``'s loss over their rescalings by the hats of a ``cells``^d
    coarse partition plus those hats (module docstring), in u's dtype; torch tensors on the
    problem's whole grid. A non-finite answer is returned as it is. ValueError where the loss
    is not quadratic in the answer. ``fields_per_pass`` bounds the fields one gradient pass
    takes (memory; default: ``NODES_PER_PASS`` nodes' worth)."""
    cells = check_cells(cells, problem.grid)
    with torch.inference_mode(False), torch.enable_grad():
        p = whole_copy(problem)
        # ordinary float64 tensors, whatever mode or dtype the caller's are in
        x = torch.from_numpy(np.array(inputs.detach().cpu().double().numpy()))
        w = torch.from_numpy(np.array(u.detach().cpu().double().numpy()))
        lines = hat_lines(p.grid, cells)
        if fields_per_pass is None:
            fields_per_pass = max(1, NODES_PER_PASS // int(np.prod(p.grid)))
        out = [correct_one(p, w[i:i + 1], x[i:i + 1], lines, cells, fields_per_pass)
               for i in range(len(w))]
    return torch.cat(out).to(u.dtype) if out else u


def correct_one(p, u, x, lines, cells: int, per_pass: int) -> torch.Tensor:
    """(1, 1, *grid) one answer corrected (float64), its system from the loss's gradients:
    the fields phi_a v, then phi_a (module docstring), never stored: ``kinds`` holds v and the
    free nodes' indicator, field k J + a is kinds[k] phi_a, and every product with the fields
    is a contraction with the 1-D hats."""
    if not bool(torch.isfinite(u).all()):
        return u
    free, lift = free_nodes(p, x)
    g = loss_gradient(p, u, x).detach() * free
    kinds = torch.cat([(u - lift) * free, free])[:, 0]                  # (2, *grid)
    gram = (coloured_gram(p, u, x, free, g, kinds, lines, per_pass)
            if colours_pay(p, cells) else None)
    if gram is None:
        gram = field_gram(p, u, x, free, g, kinds, lines, per_pass)
    # (solve_gram's shift is relative to G's diagonal: the loss's units do not matter)
    d = solve_gram(gram[None], -field_products(kinds, g[:, 0], lines)[:, 0][None])[0]
    coefficients = d.view(len(kinds), *(len(line) for line in lines))
    return u + (kinds * expand_hats(coefficients, lines)).sum(0)[None, None]


def field_products(kinds, h, lines) -> torch.Tensor:
    """(2J, C) the products f_i . h_c of the fields f_{k J + a} = kinds[k] phi_a with the
    fields h (C, *grid)."""
    return torch.cat([contract_hats(w * h, lines).reshape(len(h), -1).T for w in kinds])


def field_gram(p, u, x, free, g, kinds, lines, per_pass: int) -> torch.Tensor:
    """(2J, 2J) G from one gradient per field, ``per_pass`` fields built at a time."""
    sizes = [len(line) for line in lines]
    j = int(np.prod(sizes))
    columns, total, h_total = [], 0.0, 0.0
    for s in range(0, len(kinds) * j, per_pass):
        i = torch.arange(s, min(len(kinds) * j, s + per_pass))
        one = torch.zeros(len(i), j, dtype=torch.float64)
        one[torch.arange(len(i)), i % j] = 1.0
        f = kinds[i // j] * expand_hats(one.view(len(i), *sizes), lines)
        hf = gradient_steps(p, u, x, free, g, f[:, None], per_pass)
        columns.append(field_products(kinds, hf[:, 0], lines))
        total, h_total = total + f.sum(0), h_total + hf.sum(0, keepdim=True)
    check_affine(p, u, x, free, g, total[None, None], h_total)
    return torch.cat(columns, 1)


def gradient_steps(p, u, x, free, g, f, per_pass: int) -> torch.Tensor:
    """H f = g(u + f) - g(u) at the free nodes for the fields f (k, 1, *grid), ``per_pass``
    fields to a gradient."""
    out = []
    for s in range(0, len(f), per_pass):
        k = len(f[s:s + per_pass])
        out.append((loss_gradient(p, u.expand(k, *u.shape[1:]) + f[s:s + per_pass],
                                  x.expand(k, *x.shape[1:])).detach() * free) - g)
    return torch.cat(out)


def colours_pay(p, cells: int) -> bool:
    """Whether to try the colour classes: fewer gradients than hats, every coarse cell at
    least two nodes wide (a hat's neighbours' neighbours then lie beyond its Hessian's
    reach), and the problem's Hessian not already found wider."""
    d = len(p.grid)
    return (3 ** d < (cells + 1) ** d and all(n - 1 >= 2 * cells for n in p.grid)
            and p not in WIDE_HESSIANS)


def coloured_gram(p, u, x, free, g, kinds, lines, per_pass: int):
    """(2J, 2J) G from one gradient per kind of field and colour class (module docstring), or
    None (remembered) where the result is not symmetric: the Hessian reaches beyond a node's
    neighbours."""
    d, m1 = len(lines), len(lines[0])
    j = m1 ** d
    n = len(kinds) * j                                              # field i is of hat i mod J
    hat = np.stack(np.unravel_index(np.arange(n) % j, (m1,) * d), axis=1)      # (2J, d)
    classes = [(k, np.array(q)) for k in range(len(kinds))
               for q in itertools.product(range(3), repeat=d)]
    members = torch.stack([torch.from_numpy((hat[:j] % 3 == q).all(1)).double()
                           for _, q in classes]).view(len(classes), *(m1,) * d)
    sums = kinds[[k for k, _ in classes]] * expand_hats(members, lines)    # (classes, *grid)
    hs = gradient_steps(p, u, x, free, g, sums[:, None], per_pass)
    check_affine(p, u, x, free, g, sums.sum(0)[None, None], hs)
    prods = field_products(kinds, hs[:, 0], lines)                         # (2J, classes)
    gram = torch.zeros(n, n, dtype=torch.float64)
    for c, (k, q) in enumerate(classes):
        partner = hat + (q - hat + 1) % 3 - 1      # the neighbour (or itself) in class q
        ok = ((partner >= 0) & (partner < m1)).all(1)
        b = k * j + np.ravel_multi_index(tuple(partner[ok].T), (m1,) * d)
        gram[torch.from_numpy(np.flatnonzero(ok)), torch.from_numpy(b)] = prods[ok, c]
    size = float(gram.abs().max())
    if float((gram - gram.T).abs().max()) > SYMMETRY_RTOL * size:
        WIDE_HESSIANS.add(p)
        return None
    return gram


def check_affine(p, u, x, free, g, v, hf) -> None:
    """ValueError unless the loss's gradient is affine in the answer along v: H (2 v) from a
    gradient at u + 2 v against twice H v, the sum of ``hf`` (H of fields summing to v)."""
    twice = (loss_gradient(p, u + 2 * v, x).detach() * free) - g
    once = hf.sum(0, keepdim=True)
    size = float(twice.norm())
    if size == 0.0:
        return
    departure = float((twice - 2 * once).norm()) / size
    if not departure <= AFFINE_RTOL:
        raise ValueError(
            f"problem {p.name!r}: its loss is not quadratic in the answer (its gradient departs "
            f"from an affine one by {departure:.1e} relative), so the coarse correction, the "
            f"loss's minimiser over a coarse space built on the answer, is not a linear solve: it "
            f"needs a linear PDE and an energy or residual-norm loss; set problem.correction "
            f"= 0")
