"""Finite differences on the node grid of 1, 2 or 3 axes as fixed (never trained) convolution
kernels: 3 (1-D), 3x3 (2-D) or 3x3x3 (3-D), one implementation whatever the number of axes.

Grid convention (see ``diffnet/problems/contract/base.py``): a field is (B, 1, *grid) with the grid axes
(W), (H, W) or (D, H, W); nodes include the boundary and the spacing of each axis is its own,
``h = (hi - lo) / (n - 1)`` (domains are rarely square or cubic). The number of axes is the
length of the spacing.

Derivative names: every axis has a letter, the LAST letters of "drc" (depth, row, column): 1-D
"c"; 2-D "r", "c"; 3-D "d", "r", "c". A name lists the axes it differentiates along: once for a
first derivative (``"r"`` = d/d(row axis)), twice for a second one (``"rr"``), and two different
letters for a mixed one (``"rc"``). ``derivative_names(dims)`` lists them all: 2-D ``("r", "c",
"rr", "cc", "rc")``; 3-D adds ``"d"``, ``"dd"``, ``"dr"``, ``"dc"``.

Stencils (``kind``): every kernel is the tensor product of one 1-D factor per axis. Along an
axis the name mentions once, the central first difference [-1, 0, 1] / (2h); twice, the central
second difference [1, -2, 1] / h^2; along every axis it does not mention, the transverse
smoothing s of ``kind``:

* ``"central"``:   s = [0, 1, 0] (no smoothing)
* ``"sobel"``:     s = [1, 2, 1] / 4 (in 3-D, across both other axes: the 3-D Sobel operator)
* ``"sobel3103"``: the Scharr-like s = [3, 10, 3] / 16; in 2-D, un-normalised, the row kernel is
                   S = [[-3, -10, -3], [0, 0, 0], [3, 10, 3]] (times 1 / (32 h)) and the column
                   kernel its transpose.

So a 2-D mixed derivative ``"rc"`` is (u[i+1,j+1] - u[i+1,j-1] - u[i-1,j+1] + u[i-1,j-1]) /
(4 h_r h_c) for every kind (a 3x3 kernel leaves no room for smoothing); a 3-D one is smoothed
along its third axis.

Every stencil is second-order accurate: the central differences have error h^2/6 u''' and
h^2/12 u'''' and the smoothing adds s_1 h^2 times the second derivative across each smoothed
axis (s_1 = 1/4 sobel, 3/16 sobel3103, 0 central). Hence first derivatives are exact on
polynomials of total degree <= 2 and second and mixed ones on total degree <= 3, boundaries and
corners included (``"central"`` also on products p(along) q(across) with deg p <= 2 for first,
<= 3 for second derivatives, and deg q <= 3).

Boundary: derivatives exist on the whole grid. The field is padded by one ghost node per side
by CUBIC extrapolation, ``u[-1] = 4u[0] - 6u[1] + 4u[2] - u[3]``, one axis after the other
(depth, then rows, then columns), each axis extrapolating over the ghosts the previous ones
wrote, so edge and corner ghosts are extrapolated along every axis (exact on polynomials of
degree <= 3 in each variable, error O(h^4)); then the stencil convolution runs with no padding.
At boundary node 0 the central stencils become the one-sided, second-order

    first:  (-4u[0] + 7u[1] - 4u[2] + u[3]) / (2h)
    second: ( 2u[0] - 5u[1] + 4u[2] - u[3]) / h^2

and the exactness statements above hold on boundary nodes too. This needs at least 4 nodes per
axis. All requested derivatives come from ONE ``conv1d`` / ``conv2d`` / ``conv3d`` call with the
kernels stacked along the output channels (one pass over the field instead of one per
derivative).

On a block of a split grid (``forward(u, block)``, ``diffnet.domain.Block``), u is the block's
part: it is padded by ``block.halo(u, 1)`` (the neighbours' nodes) and only the sides on the
GLOBAL boundary get the cubic ghosts (``pad_cubic_block``), so every node's derivatives are the
undivided ones. A block on the global boundary needs at least 4 nodes along that axis.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from diffnet.validation import check_choice, check_positive_tuple, grid_axes

KINDS = ("sobel", "sobel3103", "central")
AXIS_LETTERS = "drc"     # a derivative name lists the axes it differentiates along
_SPACING_NAMES = ("h_depth", "h_row", "h_col")

# Transverse smoothing weights of each kind (they sum to 1, so constants are untouched).
_SMOOTH = {
    "central": (0.0, 1.0, 0.0),
    "sobel": (0.25, 0.5, 0.25),
    "sobel3103": (3 / 16, 10 / 16, 3 / 16),
}
_FIRST = (-0.5, 0.0, 0.5)    # times 1/h:   central first difference
_SECOND = (1.0, -2.0, 1.0)   # times 1/h^2: central second difference
# Cubic extrapolation weights of the ghost node from nodes 0..3 (exact on cubics).
_GHOST = (4.0, -6.0, 4.0, -1.0)


def derivative_names(dims: int) -> tuple[str, ...]:
    """Every derivative name of a ``dims``-axis grid: first, then second, then mixed ones."""
    letters = AXIS_LETTERS[-dims:]
    return (*letters, *(a + a for a in letters),
            *(a + b for a, b in itertools.combinations(letters, 2)))



def check_spacing(spacing) -> tuple[float, ...]:
    """The node spacing of each axis, finite and > 0; its length is the number of axes (1, 2
    or 3)."""
    try:
        dims = len(spacing)
    except TypeError:
        dims = 0
    if isinstance(spacing, (str, bytes)) or dims not in (1, 2, 3):
        raise ValueError(f"spacing must give the node spacing of 1, 2 or 3 axes, such as "
                         f"(h_row, h_col) or (h_depth, h_row, h_col), got {spacing!r}")
    form = "(" + ", ".join(_SPACING_NAMES[-dims:]) + ")"
    return check_positive_tuple("spacing", spacing, dims, form)


def _check_derivatives(derivatives, allowed) -> tuple[str, ...]:
    """Validate a non-empty sequence of distinct names from ``allowed``."""
    # A bare string would silently iterate over its characters ("rr" -> "r", "r").
    if isinstance(derivatives, str):
        raise ValueError(f"derivatives must be a sequence of names such as ('r', 'rr'), "
                         f"not the string {derivatives!r}")
    try:
        names = tuple(derivatives)
    except TypeError:
        raise ValueError(f"derivatives must be a sequence of names from {allowed}, "
                         f"got {derivatives!r}") from None
    bad = [d for d in names if d not in allowed]
    if not names or bad:
        raise ValueError(f"derivatives must be a non-empty sequence of names from {allowed}, "
                         f"got {derivatives!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"derivatives must not repeat a name, got {derivatives!r}")
    return names


def stencil_kernel(name: str, spacing, kind: str = "sobel") -> torch.Tensor:
    """The (3,) * dims float64 kernel of derivative ``name`` on a grid with this ``spacing``
    (one entry per axis); index [a, b, ...] multiplies u[i+a-1, j+b-1, ...].

    The convolutions are cross-correlations, so the kernel is written in the field's own
    orientation.
    """
    h = check_spacing(spacing)
    smooth = torch.tensor(_SMOOTH[check_choice("kind", kind, KINDS)], dtype=torch.float64)
    allowed = derivative_names(len(h))
    if name not in allowed:
        raise ValueError(f"derivative name must be one of {allowed}, got {name!r}")
    factors = []
    for axis, letter in enumerate(AXIS_LETTERS[-len(h):]):
        times = name.count(letter)
        if times == 0:
            factors.append(smooth)
        elif times == 1:
            factors.append(torch.tensor(_FIRST, dtype=torch.float64) / h[axis])
        else:
            factors.append(torch.tensor(_SECOND, dtype=torch.float64) / h[axis] ** 2)
    if len(factors) == 1:
        return factors[0]
    letters = "abc"[:len(factors)]
    return torch.einsum(",".join(letters) + "->" + letters, *factors)


def _ghost(p: torch.Tensor, dim: int, first: int, step: int) -> torch.Tensor:
    """The cubic ghost from the 4 layers p[first], p[first + step], ... along ``dim``."""
    a0, a1, a2, a3 = (a * p.narrow(dim, first + k * step, 1) for k, a in enumerate(_GHOST))
    return a0 + a1 + a2 + a3


def pad_cubic(u: torch.Tensor) -> torch.Tensor:
    """Pad (B, C, *grid) by one ghost node per side of every grid axis by cubic extrapolation
    -> each grid axis + 2.

    One axis after the other, each extrapolating over the ghosts the earlier axes wrote, so
    edge and corner ghosts are extrapolated along every axis (exact on polynomials of degree
    <= 3 in each variable, error O(h^4)). One allocation; the slice writes are tracked by
    autograd.
    """
    dims = u.dim() - 2
    p = u.new_empty((*u.shape[:2], *(n + 2 for n in u.shape[2:])))
    inner = (slice(1, -1),) * dims
    p[(slice(None), slice(None), *inner)] = u
    for a in range(dims):
        # axes before a: their whole padded extent (that is what fills edges and corners);
        # axes after a: their nodes only, their ghosts come later
        region = (slice(None),) * (2 + a)
        src = u if a == 0 else p[(*region, slice(1, -1), *inner[a + 1:])]
        dim, n = 2 + a, u.shape[2 + a]
        p[(*region, slice(0, 1), *inner[a + 1:])] = _ghost(src, dim, 0, 1)
        p[(*region, slice(n + 1, n + 2), *inner[a + 1:])] = _ghost(src, dim, n - 1, -1)
    return p


def check_block_sizes(block) -> None:
    """ValueError unless ``block`` has >= 4 nodes along every axis on which it touches the
    global boundary (the cubic ghosts read 4 of its own layers)."""
    for a in range(block.dims):
        if (block.at_lo(a) or block.at_hi(a)) and block.shape[a] < 4:
            raise ValueError(
                f"a block on the global boundary needs at least 4 nodes along axis {a} (one-sided "
                f"cubic boundary stencils), got block shape {list(block.shape)} of grid "
                f"{list(block.grid)}: split that axis into fewer blocks")


def pad_cubic_block(u: torch.Tensor, block) -> torch.Tensor:
    """This block's window of the globally cubic-padded field: (B, C, *shape) -> each axis + 2.

    ``block.halo(u, 1, "zeros")`` supplies the neighbours' nodes (edges and corners included);
    then, axis by axis in the order of ``pad_cubic``, the ghost layers on GLOBAL-boundary sides
    are replaced by the cubic extrapolation over the WHOLE padded extent of the other axes. Why
    this is the global padding's window exactly: entries off the global boundary are grid nodes
    (the block's or the halo's neighbours'), as in the global padding. A global ghost of axis a
    whose other coordinates are grid nodes is, in both, the extrapolation along a of 4 nodes
    (the block has >= 4 layers along a, so they are in the window). Where another coordinate b
    is a global ghost too: if b comes before a, the global rule extrapolates along a the ghosts
    of b, and so do we, since our ghosts of b were complete before axis a; if b comes after a,
    what we write now (from the halo's zero fill) is overwritten when axis b extrapolates over
    the whole padded extent, as globally.
    """
    check_block_sizes(block)
    p = block.halo(u, 1, "zeros")
    for a in range(block.dims):
        lo, hi = block.at_lo(a), block.at_hi(a)
        if not (lo or hi):
            continue
        dim = 2 + a
        n = p.shape[dim]
        first = _ghost(p, dim, 1, 1) if lo else p.narrow(dim, 0, 1)
        last = _ghost(p, dim, n - 2, -1) if hi else p.narrow(dim, n - 1, 1)
        p = torch.cat([first, p.narrow(dim, 1, n - 2), last], dim=dim)
    return p


def _check_block_field(u: torch.Tensor, block, dims: int) -> None:
    if block.dims != dims or tuple(u.shape[2:]) != block.shape:
        raise ValueError(f"u must be this block's part of the field, (B, 1, *{list(block.shape)})"
                         f" on a {dims}-D grid, got {tuple(u.shape)} for {block!r}")


class StencilConv(torch.autograd.Function):
    """The stencils' valid convolution of a padded (B, 1, *grid + 2) field by fixed (K, 1, 3,
    ...) kernels, whose backward is the forward convolution of the gradient by the flipped,
    transposed kernels (padding 2) instead of ATen's convolution backward. Why: with one input
    channel, oneDNN's backward-data convolution (a transposed convolution K -> 1) runs an order
    of magnitude slower than this forward one (the training step's largest loss against its
    roofline bound: ``python -m bench.roofline``, ops ``convolution_backward`` of
    ``FiniteDifference``). The same sums in another order: equal to rounding. The kernels are
    fixed: no gradient for them.
    """

    @staticmethod
    def forward(ctx, p, weight):
        ctx.save_for_backward(weight)
        return valid_convolution(p, weight)

    @staticmethod
    def backward(ctx, g):
        (weight,) = ctx.saved_tensors
        flipped = weight.flip(tuple(range(2, weight.dim()))).transpose(0, 1)
        return valid_convolution(g, flipped, padding=[k - 1 for k in weight.shape[2:]]), None


def valid_convolution(p: torch.Tensor, weight: torch.Tensor, padding=None) -> torch.Tensor:
    """The convolution (cross-correlation) of p (B, C, *n), zero-padded by ``padding`` per
    axis (default none: the valid part), by weight (K, C, *k). Float64 as a sum of shifted views
    over the kernel's non-zero taps: ATen has no oneDNN kernel for float64 and its fallback
    unfolds every tap (im2col), several times slower for these sparse 3^d stencils (the coarse
    correction's float64 gradients spend most of their time here). Other dtypes: ``F.conv*d``
    (oneDNN). Equal to rounding; differentiable either way."""
    padding = list(padding or [0] * (weight.dim() - 2))
    if p.dtype != torch.float64:
        return getattr(F, f"conv{weight.dim() - 2}d")(p, weight, padding=padding)
    if any(padding):
        p = F.pad(p, [k for k in reversed(padding) for _ in (0, 1)])
    size = [n - k + 1 for n, k in zip(p.shape[2:], weight.shape[2:])]
    out = p.new_zeros(p.shape[0], weight.shape[0], *size)
    for k, c, *tap in torch.nonzero(weight).tolist():
        window = tuple(slice(i, i + n) for i, n in zip(tap, size))
        out[:, k].add_(p[(slice(None), c) + window], alpha=float(weight[(k, c, *tap)]))
    return out


class FiniteDifference(torch.nn.Module):
    """Derivatives of a (B, 1, *grid) field on a node grid of 1, 2 or 3 axes, in one
    convolution pass.

    Args:
        spacing: the node spacing of each axis, (h,), (h_row, h_col) or (h_depth, h_row,
            h_col) (positive); its length is the number of grid axes, ``dims``.
        kind: one of ``KINDS`` (see the module docstring for the stencils); second order.
        derivatives: names from ``derivative_names(dims)``; output channel k is
            ``derivatives[k]``. Default: the first and second derivative along every axis.

    forward(u, block=None): (B, 1, *grid) with >= 4 nodes per axis -> (B, len(derivatives),
    *grid), values on every node including the boundary (cubic ghost nodes, see the module
    docstring). With a split ``block`` (``diffnet.domain.Block``), u is the block's part
    (B, 1, *block.shape) and the result its part of the undivided derivatives
    (``pad_cubic_block``).

    The kernels are a float64 buffer (accurate 1/h, 1/h^2 factors; it follows ``.to(dtype)``)
    and are cast to the input's dtype/device in forward: a no-op when they already match.

    Examples:
        One axis (its letter is "c"): u = x^2 on [0, 1], exact first and second derivatives.

        >>> import torch
        >>> from diffnet.stencils import FiniteDifference
        >>> x = torch.linspace(0, 1, 11, dtype=torch.float64)
        >>> fd = FiniteDifference((0.1,), "central", derivatives=("c", "cc"))
        >>> d = fd((x ** 2)[None, None])
        >>> d.shape
        torch.Size([1, 2, 11])
        >>> torch.allclose(d[0, 0], 2 * x), torch.allclose(d[0, 1], torch.full_like(x, 2.0))
        (True, True)

        Two axes, rows y on [0, 1] and columns x on [0, 2]: u = x y.

        >>> y, x = torch.meshgrid(torch.linspace(0, 1, 5, dtype=torch.float64),
        ...                       torch.linspace(0, 2, 9, dtype=torch.float64), indexing="ij")
        >>> fd = FiniteDifference((0.25, 0.25), "sobel", derivatives=("r", "c", "rc"))
        >>> d = fd((x * y)[None, None])[0]
        >>> torch.allclose(d[fd.index("r")], x), torch.allclose(d[fd.index("c")], y)
        (True, True)
        >>> torch.allclose(d[fd.index("rc")], torch.ones_like(x))
        True

        Three axes, the same code: the Laplacian of z^2 + y^2 + x^2 is 6.

        >>> g = torch.linspace(0, 1, 6, dtype=torch.float64)
        >>> z, y, x = torch.meshgrid(g, g, g, indexing="ij")
        >>> fd = FiniteDifference((0.2, 0.2, 0.2), derivatives=("dd", "rr", "cc"))
        >>> fd.dims, fd((z ** 2 + y ** 2 + x ** 2)[None, None]).sum(1).sub(6).abs().max() < 1e-9
        (3, tensor(True))
    """

    def __init__(self, spacing, kind: str = "sobel", derivatives=None):
        super().__init__()
        self.spacing = check_spacing(spacing)
        self.dims = len(self.spacing)
        self.kind = check_choice("kind", kind, KINDS)
        letters = AXIS_LETTERS[-self.dims:]
        if derivatives is None:
            derivatives = (*letters, *(a + a for a in letters))
        self.derivatives = _check_derivatives(derivatives, derivative_names(self.dims))
        weight = torch.stack([stencil_kernel(d, self.spacing, self.kind) for d in self.derivatives])
        # (K, 1, 3, ...): one output channel per derivative, one conv for all of them.
        self.register_buffer("weight", weight.unsqueeze(1), persistent=False)

    def index(self, name: str) -> int:
        """Output channel of derivative ``name``."""
        if name not in self.derivatives:
            raise ValueError(f"name must be one of the computed derivatives {self.derivatives}, "
                             f"got {name!r}")
        return self.derivatives.index(name)

    def forward(self, u: torch.Tensor, block=None) -> torch.Tensor:
        form = f"(B, 1, {grid_axes(self.dims)})"
        if u.dim() != 2 + self.dims or u.shape[1] != 1:
            raise ValueError(f"u must have shape {form}, got {tuple(u.shape)}")
        whole = block is None or block.whole
        if whole and min(u.shape[2:]) < 4:
            raise ValueError(f"u must have at least 4 nodes per axis (one-sided cubic boundary "
                             f"stencils), got grid {tuple(u.shape[2:])}")
        if not whole:
            _check_block_field(u, block, self.dims)
        if not u.is_floating_point():
            raise ValueError(f"u must be a floating-point tensor, got dtype {u.dtype}")
        weight = self.weight.to(device=u.device, dtype=u.dtype)
        # F.conv*d looked up per call (valid_convolution), so that a test can count them
        return StencilConv.apply(pad_cubic(u) if whole else pad_cubic_block(u, block), weight)

    def extra_repr(self) -> str:
        return f"spacing={self.spacing}, kind={self.kind!r}, derivatives={self.derivatives}"


def gradient(u: torch.Tensor, spacing, kind: str = "sobel") -> tuple[torch.Tensor, ...]:
    """The first derivative along every grid axis, each (B, 1, *grid): in 2-D (du/drow,
    du/dcol). A one-off ``FiniteDifference``: build one once instead in a training loop."""
    dims = len(check_spacing(spacing))
    d = FiniteDifference(spacing, kind, derivatives=tuple(AXIS_LETTERS[-dims:]))(u)
    return tuple(d[:, k:k + 1] for k in range(dims))
