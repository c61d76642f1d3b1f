"""The Ritz-Galerkin answer of a linear problem with an energy, from the network's fields: the
numerics of the answer head ``heads.Ritz`` (which takes the energy from a ``QuadraticEnergy``).

For a problem whose solution minimises E(u) = a(u, u) / 2 - l(u) over a linear space (zero
boundary data: every combination of admissible fields is admissible), the best answer in the
span of K fields u_1..u_K is exact and cheap: sum_i c_i u_i with G c = b, G_ij = a(u_i, u_j),
b_i = l(u_i), per sample (a K x K solve), and its energy is -b.G^-1.b / 2. K = 1 is the
scaling c = l(u) / a(u, u). The problem gives its quadratic energy as weighted squares,
a(u, u) / 2 = sum over pairs (F, w) of sum(w F(u)^2) with F linear, so G is sums of
w F(u_i) F(u_j): one batched product, K evaluations of F rather than the K (K + 1) / 2 energies
that polarisation (a(u + v, u + v) - a(u, u) - a(v, v)) would take, markedly cheaper at K = 16
(measured: lab/notes/readme-second-release.md, "Ritz scaling"). The network then only has to
span the solution, not to get its amplitudes right: the amplitudes are global (for Darcy the
effective conductivity of the whole medium) and the energy's flattest directions, where
gradient training converges slowest.

With a partition (``Partition``, m > 0) the coefficients are not numbers but fields: bilinear on
an m x m coarse grid, c_i(x) = sum_a c_ia phi_a(x) over the (m + 1)^2 hats phi_a, a partition
of unity. The answer sum_i c_i(x) u_i(x) is the Galerkin solution in the span of the K (m + 1)^2
products u_i phi_a (the partition of unity method of Melenk and Babuska, 1996, with the
network's fields as the local approximation spaces). That span holds the K fields themselves
(the hats sum to one), so the energy of the answer is never above the plain combination's: a
field whose amplitude is right in one region and wrong in another is corrected region by
region. Each node or edge lies in one coarse cell, where only its four corner hats are
non-zero, so G is assembled cell by cell from the features of 4 K fields (u_i times the four
parity classes of hats) rather than K (m + 1)^2.

Gradients: the coefficients are computed without autograd by default. The loss is the energy
E, and c minimises E over the span, so dE/dc = 0 there and the energy's gradient with respect
to the fields is its partial derivative at fixed c (the envelope theorem; exact up to the
1e-7 shift of G). Differentiating through G and its solve would add nothing to that gradient
and cost a backward pass through a dense (K (m + 1)^2)^2 factorisation per sample, which at
m = 8, K = 16 makes a training step an order of magnitude slower (measured:
lab/notes/readme-second-release.md, "Training with it"). ``differentiate=True`` keeps the full
graph, for a loss that is not this energy (tests compare the two gradients).
"""
from __future__ import annotations

from typing import Callable

import torch

# G + REG * mean(diag G) * I: fields a network makes nearly dependent (at initialisation, say)
# give a near-singular G; the shift bounds c at a relative energy cost of ~REG.
REG = 1e-7
# Elements per float64 chunk when G is summed from float32 features (32 MiB).
CHUNK = 1 << 22


def gram(features: list, b: int, k: int) -> torch.Tensor:
    """(b, k, k) float64 a(u_i, u_j) from the pairs (F, w) of b samples' k fields (F's first
    dims (b, k) or (b * k,)): a(u, v) = 2 sum over the pairs of sum(w F(u) F(v)), the
    products summed in float64 (``gram_of_scaled``)."""
    return gram_of_scaled(scaled(features), b, k)


def scaled(features: list) -> list:
    """The features F sqrt(w) (w >= 0): a(u, v) = 2 sum of their products, no weight left."""
    return [f * w.sqrt() for f, w in features]


def gram_of_scaled(feats: list, b: int, k: int) -> torch.Tensor:
    """(b, k, k) float64 2 sum over the scaled features S of S_i . S_j (see ``gram``), summed
    in float64 whatever S's dtype. A product of two float32 numbers is exact in float64; a
    float32 sum of ~10^6 of them is not, and G^-1 amplifies its error where the K fields are
    nearly dependent: with float32 sums at 1024x1024 (K = 16) c goes wrong on some samples,
    a training step can show a positive energy (impossible for the exact c) and gradient
    norms four orders of magnitude above the usual (lab/notes/readme-second-release.md).
    Float32 features are converted in chunks, so the float64 copy stays small."""
    g = 0
    for f in feats:
        f = f.reshape(b, k, -1)
        step = f.shape[-1] if f.dtype == torch.float64 else max(1, CHUNK // (b * k))
        for s in range(0, f.shape[-1], step):
            g = g + 2 * self_products(f[..., s:s + step].double())
    return g


def self_products(c: torch.Tensor) -> torch.Tensor:
    """(b, k, k) c c^T of c (b, k, n). With fewer samples than threads, n is cut into one
    part per thread, batched, and the parts' products summed: one sample's (k x n)(n x k)
    product with k = 64 and n ~ 16,000 does not keep two threads busy. A small gain on the
    1024² partition answer (measured: lab/notes/readme-second-release.md)."""
    b, k, n = c.shape
    t = torch.get_num_threads()
    if t == 1 or b >= t or n < t:
        return torch.bmm(c, c.transpose(1, 2))
    m = n // t * t
    parts = c[..., :m].reshape(b, k, t, m // t).transpose(1, 2)  # (b, t, k, m / t)
    # one sample: a strided view, no copy (rows n apart, parts m / t apart)
    parts = parts[0] if b == 1 else parts.reshape(b * t, k, m // t)
    g = torch.bmm(parts, parts.transpose(1, 2)).view(b, t, k, k).sum(1)
    if m < n:
        rest = c[..., m:]
        g = g + torch.bmm(rest, rest.transpose(1, 2))
    return g


def ritz_combination(u: torch.Tensor, features: Callable, ell: Callable,
                     total: Callable, differentiate: bool = False) -> torch.Tensor:
    """(B, 1, *grid) the energy's minimiser in the span of the K fields of u (B, K, *grid).

    ``features(u)``: the pairs (F, w) of the fields u (B, K, *grid), F (B, K, ...), with
    a(u_i, u_i) / 2 = sum over the pairs of sum(w F^2) over field i's entries (see
    ``diffusion_features``); ``ell(v)``: (N,) l(v) of v (N, 1, *grid), N = B * K
    (sample-major: the fields of sample 0 first). On a split grid both give this
    block's parts, and ``total`` sums a tensor over the blocks (identity when undivided). G and
    b are assembled and G c = b is solved in float64; autograd sees c as a constant unless
    ``differentiate`` (see the module docstring)."""
    b, k = u.shape[:2]
    with torch.set_grad_enabled(differentiate and torch.is_grad_enabled()):
        v = u.float() if u.dtype in (torch.float16, torch.bfloat16) else u
        flat = v.reshape(b * k, 1, *v.shape[2:])
        g = total(gram(features(v), b, k))
        rhs = total(ell(flat).view(b, k)).double()
        c = solve_gram(g, rhs)
    return (u * c.to(u.dtype).view((b, k) + (1,) * (u.dim() - 2))).sum(dim=1, keepdim=True)


def solve_gram(g: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """(b, n) float64 c with G c = rhs, G (b, n, n) symmetrised and shifted by REG.

    By Cholesky (G is positive definite once shifted), not a batched LU: torch 2.13's batched
    ``linalg.solve`` on more than one thread fails for n >= ~200 (MKL rejects the pivots:
    "Pivots given to lu_solve must all be greater or equal to 1"), the size of a partition's
    G. Where Cholesky fails to rounding, one LU solve per sample."""
    b, n = rhs.shape
    if n == 1:
        return rhs / g[:, :, 0].clamp_min(torch.finfo(g.dtype).tiny)
    g = 0.5 * (g + g.transpose(1, 2))                             # symmetric to rounding
    shift = REG * g.diagonal(dim1=1, dim2=2).mean(dim=1).clamp_min(torch.finfo(g.dtype).tiny)
    g = g + shift.view(b, 1, 1) * torch.eye(n, dtype=g.dtype)
    chol, info = torch.linalg.cholesky_ex(g)
    if bool((info == 0).all()):
        return torch.cholesky_solve(rhs.unsqueeze(-1), chol).squeeze(-1)
    return torch.stack([torch.linalg.solve(g[i], rhs[i]) for i in range(b)])


def coarse_lines(n: int, m: int) -> list[int]:
    """The m + 1 node indices of an axis of ``n`` nodes that the lines of an m-cell coarse
    partition sit on: round(c (n - 1) / m), c = 0..m."""
    return [round(c * (n - 1) / m) for c in range(m + 1)]


def line_hats(n: int, lines) -> torch.Tensor:
    """(len(lines), n) float64 1-D hats over the node indices of an axis of ``n`` nodes: hat c
    is 1 on node ``lines[c]``, 0 on the other lines, linear in the node index between them."""
    i = torch.arange(n, dtype=torch.float64)
    t = torch.zeros(n, dtype=torch.float64)                   # the coarse coordinate
    for c in range(len(lines) - 1):
        lo, hi = lines[c], lines[c + 1]
        seg = (i >= lo) & (i <= hi)
        t[seg] = c + (i[seg] - lo) / (hi - lo)
    return (1 - (t[None] - torch.arange(len(lines), dtype=torch.float64)[:, None]).abs()
            ).clamp_min(0)


class Partition:
    """The (m + 1)^2 bilinear hats phi_a of an m x m coarse partition of a 2-D node grid.

    Along an axis of L nodes the coarse lines sit on the nodes n_c = round(c (L - 1) / m),
    c = 0..m; hat c is piecewise linear in the node index, 1 on line c and 0 on the others, so
    the hats sum to one at every node and between lines c and c + 1 only hats c and c + 1 are
    non-zero. A node i, or an edge (i, i + 1), belongs to the cell c with n_c <= i < n_(c+1)
    (the last cell also holds the last node): it lies in that closed cell, where only the
    cell's four corner hats are non-zero, and the corners have the four parities of (a_y, a_x).
    Hats are numbered a = a_y (m + 1) + a_x."""

    def __init__(self, grid, m: int):
        assert len(grid) == 2 and 1 <= m <= min(grid) - 1, (grid, m)
        self.grid, self.m = tuple(grid), m
        self.lines = [coarse_lines(n, m) for n in grid]
        self.hats = [line_hats(n, lines) for n, lines in zip(grid, self.lines)]

    def block_hats(self, block, like: torch.Tensor):
        """The 1-D hats (m + 1, n_y), (m + 1, n_x) cut to the block's nodes, in like's dtype."""
        return [h[:, s:s + n].to(like) for h, s, n in zip(self.hats, block.start, block.shape)]

    def colours(self, block, like: torch.Tensor) -> torch.Tensor:
        """(4, n_y, n_x): the sums of the hats of each parity (q_y, q_x), q = 2 q_y + q_x."""
        hy, hx = self.block_hats(block, like)
        py, px = (torch.stack([h[0::2].sum(0), h[1::2].sum(0)]) for h in (hy, hx))
        return (py[:, None, :, None] * px[None, :, None, :]).reshape(4, *py.shape[1:2],
                                                                     px.shape[1])

    def cells(self):
        """(cell row range, cell column range, the hat of each parity (4,)) per cell, ranges
        in global node/edge indices, the last one open-ended."""
        m = self.m
        for cy in range(m):
            for cx in range(m):
                rng = [(ln[c], ln[c + 1] if c < m - 1 else None)
                       for ln, c in zip(self.lines, (cy, cx))]
                corner = [[c if c % 2 == q else c + 1 for q in (0, 1)] for c in (cy, cx)]
                yield rng, [corner[0][q // 2] * (m + 1) + corner[1][q % 2] for q in range(4)]


def _cut_cell(t: torch.Tensor, rng, start) -> torch.Tensor | None:
    """The part of a scaled feature t (..., fy, fx) that lies in the cell's global ranges, on a
    block whose first node is ``start``; None when empty."""
    for a, ((lo, hi), s) in enumerate(zip(rng, start)):
        f = t.shape[t.dim() - 2 + a]
        lo, hi = max(lo - s, 0), f if hi is None else min(hi - s, f)
        if hi <= lo:
            return None
        t = t.narrow(t.dim() - 2 + a, lo, hi - lo)
    return t


def partition_combination(u: torch.Tensor, features: Callable, load: torch.Tensor,
                          total: Callable, partition: Partition, block,
                          differentiate: bool = False,
                          window_features: Callable | None = None) -> torch.Tensor:
    """(B, 1, H, W) the energy's minimiser in the span of u_i phi_a (see the module docstring):
    the K fields of u (B, K, H, W) times the partition's hats, on ``block`` (its part, with
    ``total`` summing over the blocks). ``features`` as for ``ritz_combination``; ``load``
    the nodal weights of l (l(v) = sum(load * v), broadcasting to (B, 1, H, W)), so that
    b_ia = l(u_i phi_a) is two small products with the 1-D hats. The features must be local
    (an edge or node feature of u phi depends on the node values of its own edge or node only:
    the two-point faces and nodal terms are, a wider stencil is not). Float64; c is a
    constant to autograd unless ``differentiate``. ``window_features(v, start, stop)`` (used
    on an undivided ``block`` only, ignored on a split one): the pairs of the edges and nodes
    a cell owns from v cut to the closed cell, [start, stop] per axis; with it G is assembled
    cell by cell from the cell's own coloured fields, which stay in cache, instead of
    colouring and differencing the whole grid first (at 1024x1024, K = 16, m = 8 that is
    4 K float64 fields of 8 MiB, per pass)."""
    b, k = u.shape[:2]
    m1 = partition.m + 1
    with torch.set_grad_enabled(differentiate and torch.is_grad_enabled()):
        # float64: summed in float32 the cell products move the answer by about a percent
        # (the cell Gram matrices are ill-conditioned), the size of what it corrects.
        # Float32 features summed in float64 moved it by 2e-7, but would save only traffic.
        v = u.double()
        colours = partition.colours(block, v)
        if window_features is not None and block.whole:
            g = _window_gram(v, colours, window_features, partition, b, k)
        else:
            coloured = (v[:, :, None] * colours).reshape(b, 4 * k, *v.shape[2:])
            g = _cell_gram(features(coloured), partition, block, b, k)
        hy, hx = partition.block_hats(block, v)
        rhs = hy @ ((v * load.to(v)) @ hx.T)                      # (b, k, m + 1, m + 1)
        c = solve_gram(total(g), total(rhs.reshape(b, k * m1 * m1)).double())
    # the coefficient fields in u's dtype: the answer is, and float64 would double the traffic
    hy, hx = partition.block_hats(block, u)
    coef = hy.T @ c.to(u.dtype).view(b, k, m1, m1) @ hx          # (b, k, h, w)
    return (u * coef).sum(dim=1, keepdim=True)


def _window_gram(v, colours, window_features: Callable, partition: Partition, b: int,
                 k: int) -> torch.Tensor:
    """``_cell_gram`` with each cell's features made from its own window of v (see
    ``partition_combination``): the same G, in cache-sized pieces."""
    def features(rng):
        start = [lo for lo, _ in rng]
        stop = [n if hi is None else hi for (_, hi), n in zip(rng, partition.grid)]
        win = tuple(slice(a, min(z + 1, n)) for a, z, n in zip(start, stop, partition.grid))
        coloured = (v[(..., None) + win] * colours[(...,) + win]).reshape(
            b, 4 * k, *(s.stop - s.start for s in win))
        return [f * w.sqrt() for f, w in window_features(coloured, start, stop)]
    return _scatter_cells(((rng, hats, features(rng)) for rng, hats in partition.cells()),
                          partition, b, k)


def _cell_gram(feats: list, partition: Partition, block, b: int, k: int) -> torch.Tensor:
    """(b, K J, K J) G (this block's part) from the features of the 4 K coloured fields: per
    cell, the Gram matrix of its edges and nodes, scattered to the cell's four hats. Each
    cell's part of a feature is cut and multiplied by its part of sqrt(w) in one pass, which
    makes the contiguous copy the product needs anyway: scaling the whole feature first and
    copying each cut after was two more passes over the largest tensors here (at 1024x1024,
    K = 16: 4 K float64 fields of 8 MiB each, per feature)."""
    feats = [torch.broadcast_tensors(f, w.sqrt()) for f, w in feats]

    def cut(rng):
        pieces = [(_cut_cell(f, rng, block.start), _cut_cell(s, rng, block.start))
                  for f, s in feats]
        return [f * s for f, s in pieces if f is not None]
    return _scatter_cells(((rng, hats, cut(rng)) for rng, hats in partition.cells()),
                          partition, b, k)


def _scatter_cells(cells, partition: Partition, b: int, k: int) -> torch.Tensor:
    """(b, K J, K J) G from (range, the cell's four hats, its scaled features) per cell."""
    j = (partition.m + 1) ** 2
    field = torch.arange(k).repeat_interleave(4) * j                # local (i, q) -> i J + hat
    where, parts = [], []
    for _, hats, cut in cells:
        if not cut:
            continue
        idx = field + torch.tensor(hats).repeat(k)
        where.append((idx[:, None] * (k * j) + idx[None, :]).reshape(-1))
        parts.append(gram_of_scaled(cut, b, 4 * k).reshape(b, -1))
    # one scatter of every cell's block: adding them one by one copies G once per cell
    g = torch.zeros(b, (k * j) ** 2, dtype=torch.float64)
    if parts:
        g = g.index_add(1, torch.cat(where), torch.cat(parts, dim=1))
    return g.view(b, k * j, k * j)
