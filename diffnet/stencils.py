"""Finite differences on the node grid as fixed (never trained) 3x3 (2-D) and 3x3x3 (3-D)
convolution kernels.

Grid convention (see ``diffnet/problems/base.py``): a field is (B, 1, H, W), rows run along
``axes[0]`` and columns along ``axes[1]``, nodes include the boundary and the spacing of each
axis is its own, ``h = (hi - lo) / (n - 1)`` (domains are rarely square).

Derivative names: ``"r"`` = d/d(row axis), ``"c"`` = d/d(column axis), ``"rr"``, ``"cc"`` the
second derivatives and ``"rc"`` the mixed one.

Stencils (``kind``), along the derivative axis with spacing h, with transverse weights s:

* ``"central"``:   first  (u[i+1] - u[i-1]) / (2h),         s = [0, 1, 0]
                   second (u[i+1] - 2u[i] + u[i-1]) / h^2,   s = [0, 1, 0]
* ``"sobel"``:     the same along the axis, smoothed across it with s = [1, 2, 1] / 4
* ``"sobel3103"``: the same, with the Scharr-like s = [3, 10, 3] / 16; un-normalised the row
                   kernel is S = [[-3, -10, -3], [0, 0, 0], [3, 10, 3]] (times 1 / (32 h)) and the
                   column kernel its transpose.
* ``"rc"`` (every kind): (u[i+1,j+1] - u[i+1,j-1] - u[i-1,j+1] + u[i-1,j-1]) / (4 h_r h_c);
  a 3x3 kernel leaves no room for transverse smoothing.

Every stencil is second-order accurate: the central differences have error h^2/6 u''' and
h^2/12 u'''' and the transverse smoothing adds h^2/4 (sobel) or 3h^2/16 (sobel3103) times the
second transverse derivative. Hence ``r``, ``c`` are exact on polynomials of total degree <= 2,
``rr``, ``cc``, ``rc`` on total degree <= 3 (``"central"`` also on products p(along) q(across)
with deg p <= 2 for first, <= 3 for second derivatives, and deg q <= 3).

Boundary: residuals exist on the whole grid. The field is padded by one ghost node per side by
CUBIC extrapolation, ``u[-1] = 4u[0] - 6u[1] + 4u[2] - u[3]`` (rows first, then columns of the
row-padded field, so the corners are extrapolated in both directions), then the stencil conv
runs with no padding. The ghost is exact on cubics (error O(h^4)), so at boundary node 0 the
central stencils become the one-sided, second-order

    first:  (-4u[0] + 7u[1] - 4u[2] + u[3]) / (2h)
    second: ( 2u[0] - 5u[1] + 4u[2] - u[3]) / h^2

and the exactness statements above hold on boundary nodes too. This needs at least 4 nodes per
axis. All requested derivatives come from ONE ``conv2d`` call with the kernels stacked along
the output channels (one pass over the field instead of one per derivative).

On a block of a split grid (``forward(u, block)``, ``diffnet.domain.Block``), u is the block's
part: it is padded by ``block.halo(u, 1)`` (the neighbours' nodes) and only the sides on the
GLOBAL boundary get the cubic ghosts (``pad_cubic_block``), so every node's derivatives are the
undivided ones. A block on the global boundary needs at least 4 nodes along that axis.

3-D (``FiniteDifference3D``, fields (B, 1, D, H, W), axes depth, row, column with their own
spacings (h_d, h_r, h_c)): 3x3x3 ``conv3d`` kernels, the tensor products of the same 1-D
factors. Names ``"d"``, ``"r"``, ``"c"`` (first), ``"dd"``, ``"rr"``, ``"cc"`` (second) and
``"dr"``, ``"dc"``, ``"rc"`` (mixed); along each axis the name mentions once the factor is the
central first difference, twice the second difference, and along every axis it does not mention
the transverse smoothing s of ``kind``:

* first, e.g. ``"c"``:   s(d) x s(r) x [-1, 0, 1] / (2 h_c)   (sobel: the 3-D Sobel operator,
  [1, 2, 1] / 4 smoothing across BOTH other axes)
* second, e.g. ``"cc"``: s(d) x s(r) x [1, -2, 1] / h_c^2
* mixed, e.g. ``"rc"``:  s(d) x [-1, 0, 1] / (2 h_r) x [-1, 0, 1] / (2 h_c)   (unlike 2-D, a
  3x3x3 kernel has room to smooth the mixed derivative along the third axis)

Order: second, as in 2-D. The smoothing adds s_1 h^2 times the second derivative across each
smoothed axis (s_1 = 1/4 sobel, 3/16 sobel3103, 0 central), so first derivatives are exact on
polynomials of total degree <= 2 and second and mixed ones on total degree <= 3, boundaries and
corners included. Boundary: the same cubic ghost closure, one axis after the other (depth,
then rows, then columns, so edge and corner ghosts are extrapolated along every axis; exact on
polynomials of degree <= 3 in each variable), giving the same one-sided formulas at the faces.
All requested derivatives come from ONE ``conv3d`` call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .validation import check_choice, check_positive_pair, check_positive_tuple, grid_axes

KINDS = ("sobel", "sobel3103", "central")
DERIVATIVES = ("r", "c", "rr", "cc", "rc")
DERIVATIVES_3D = ("d", "r", "c", "dd", "rr", "cc", "dr", "dc", "rc")
_AXIS_LETTERS_3D = "drc"   # a 3-D derivative name lists the axes it differentiates along

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


def _check_derivatives(derivatives, allowed=DERIVATIVES) -> tuple[str, ...]:
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
    """The (3, 3) float64 kernel of derivative ``name``; index [a, b] multiplies u[i+a-1, j+b-1].

    conv2d is a cross-correlation, so the kernel is written in the field's own orientation.
    """
    h_r, h_c = check_positive_pair("spacing", spacing, "(h_row, h_col)")
    smooth = torch.tensor(_SMOOTH[check_choice("kind", kind, KINDS)], dtype=torch.float64)
    first = torch.tensor(_FIRST, dtype=torch.float64)
    second = torch.tensor(_SECOND, dtype=torch.float64)
    if name == "r":
        return torch.outer(first / h_r, smooth)
    if name == "c":
        return torch.outer(smooth, first / h_c)
    if name == "rr":
        return torch.outer(second / h_r**2, smooth)
    if name == "cc":
        return torch.outer(smooth, second / h_c**2)
    if name == "rc":
        return torch.outer(first / h_r, first / h_c)
    raise ValueError(f"derivative name must be one of {DERIVATIVES}, got {name!r}")


def pad_cubic(u: torch.Tensor) -> torch.Tensor:
    """Pad (B, C, H, W) by one ghost node per side by cubic extrapolation -> (B, C, H+2, W+2).

    Rows first, then the columns of the row-padded field, so corner ghosts are extrapolated in
    both directions (exact on polynomials of degree <= 3 in each variable, error O(h^4)).
    One allocation; the slice writes are tracked by autograd.
    """
    b, c, h, w = u.shape
    p = u.new_empty((b, c, h + 2, w + 2))
    a0, a1, a2, a3 = _GHOST
    p[:, :, 1:-1, 1:-1] = u
    p[:, :, 0, 1:-1] = a0 * u[:, :, 0] + a1 * u[:, :, 1] + a2 * u[:, :, 2] + a3 * u[:, :, 3]
    p[:, :, -1, 1:-1] = a0 * u[:, :, -1] + a1 * u[:, :, -2] + a2 * u[:, :, -3] + a3 * u[:, :, -4]
    # The columns read the just-written ghost rows: that is what fills the corners.
    q = p[:, :, :, 1:-1]
    p[:, :, :, 0] = a0 * q[..., 0] + a1 * q[..., 1] + a2 * q[..., 2] + a3 * q[..., 3]
    p[:, :, :, -1] = a0 * q[..., -1] + a1 * q[..., -2] + a2 * q[..., -3] + a3 * q[..., -4]
    return p


def _ghost_layer(p: torch.Tensor, dim: int, first: int, step: int) -> torch.Tensor:
    """The cubic ghost from the 4 layers p[first], p[first + step], ... along ``dim``."""
    return sum(a * p.narrow(dim, first + k * step, 1) for k, a in enumerate(_GHOST))


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
    then, axis by axis in the order of ``pad_cubic`` / ``pad_cubic_3d``, the ghost layers on
    GLOBAL-boundary sides are replaced by the cubic extrapolation over the WHOLE padded extent
    of the other axes. Why this is the global padding's window exactly: entries off the global
    boundary are grid nodes (the block's or the halo's neighbours'), as in the global padding.
    A global ghost of axis a whose other coordinates are grid nodes is, in both, the
    extrapolation along a of 4 nodes (the block has >= 4 layers along a, so they are in the
    window). Where another coordinate b is a global ghost too: if b comes before a, the global
    rule extrapolates along a the ghosts of b, and so do we, since our ghosts of b were
    complete before axis a; if b comes after a, what we write now (from the halo's zero fill)
    is overwritten when axis b extrapolates over the whole padded extent, as globally.
    """
    check_block_sizes(block)
    p = block.halo(u, 1, "zeros")
    for a in range(block.dims):
        lo, hi = block.at_lo(a), block.at_hi(a)
        if not (lo or hi):
            continue
        dim = 2 + a
        n = p.shape[dim]
        first = _ghost_layer(p, dim, 1, 1) if lo else p.narrow(dim, 0, 1)
        last = _ghost_layer(p, dim, n - 2, -1) if hi else p.narrow(dim, n - 1, 1)
        p = torch.cat([first, p.narrow(dim, 1, n - 2), last], dim=dim)
    return p


def _check_block_field(u: torch.Tensor, block, dims: int) -> None:
    if block.dims != dims or tuple(u.shape[2:]) != block.shape:
        raise ValueError(f"u must be this block's part of the field, (B, 1, *{list(block.shape)})"
                         f" on a {dims}-D grid, got {tuple(u.shape)} for {block!r}")


class FiniteDifference(torch.nn.Module):
    """Derivatives of a (B, 1, H, W) field on the node grid, in one conv2d pass.

    Args:
        spacing: (h_row, h_col) node spacing, each axis its own (positive).
        kind: one of ``KINDS`` (see the module docstring for the stencils); second order.
        derivatives: names from ("r", "c", "rr", "cc", "rc"); output channel k is
            ``derivatives[k]``.

    forward(u, block=None): (B, 1, H, W) with H, W >= 4 -> (B, len(derivatives), H, W), values
    on every node including the boundary (cubic ghost nodes, see the module docstring). With a
    split ``block`` (``diffnet.domain.Block``), u is the block's part (B, 1, *block.shape) and
    the result its part of the undivided derivatives (``pad_cubic_block``).

    The kernels are a float64 buffer (accurate 1/h, 1/h^2 factors; it follows ``.to(dtype)``)
    and are cast to the input's dtype/device in forward: a no-op when they already match.
    """

    # the axes, convolution and whole-grid padding of this dimension (FiniteDifference3D: 3-D)
    dims = 2
    conv = "conv2d"                 # a name, looked up in F per call (tests count the convs)
    pad_whole = staticmethod(pad_cubic)

    def __init__(self, spacing: tuple[float, float], kind: str = "sobel",
                 derivatives=("r", "c", "rr", "cc")):
        super().__init__()
        self.spacing = check_positive_pair("spacing", spacing, "(h_row, h_col)")
        self.kind = check_choice("kind", kind, KINDS)
        self.derivatives = _check_derivatives(derivatives)
        weight = torch.stack([stencil_kernel(d, self.spacing, self.kind) for d in self.derivatives])
        # (K, 1, 3, 3): one output channel per derivative, one conv for all of them.
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
        return getattr(F, self.conv)(self.pad_whole(u) if whole else pad_cubic_block(u, block),
                                     weight)

    def extra_repr(self) -> str:
        return f"spacing={self.spacing}, kind={self.kind!r}, derivatives={self.derivatives}"


def gradient(u: torch.Tensor, spacing, kind: str = "sobel") -> tuple[torch.Tensor, torch.Tensor]:
    """(du/drow, du/dcol), each (B, 1, H, W): a one-off FiniteDifference(("r", "c")).

    Build a FiniteDifference once instead when calling this in a training loop.
    """
    d = FiniteDifference(spacing, kind, derivatives=("r", "c"))(u)
    return d[:, 0:1], d[:, 1:2]


# ----------------------------------------------------------------------------------------------
# 3-D: the same stencils as tensor products on (B, 1, D, H, W) fields, one conv3d.
# ----------------------------------------------------------------------------------------------

SPACING_3D = "(h_depth, h_row, h_col)"


def stencil_kernel_3d(name: str, spacing, kind: str = "sobel") -> torch.Tensor:
    """The (3, 3, 3) float64 kernel of 3-D derivative ``name`` (one of ``DERIVATIVES_3D``);
    index [a, b, c] multiplies u[i+a-1, j+b-1, k+c-1] (conv3d is a cross-correlation)."""
    h = check_positive_tuple("spacing", spacing, 3, SPACING_3D)
    smooth = torch.tensor(_SMOOTH[check_choice("kind", kind, KINDS)], dtype=torch.float64)
    if name not in DERIVATIVES_3D:
        raise ValueError(f"derivative name must be one of {DERIVATIVES_3D}, got {name!r}")
    factors = []
    for axis, letter in enumerate(_AXIS_LETTERS_3D):
        times = name.count(letter)
        if times == 0:
            factors.append(smooth)
        elif times == 1:
            factors.append(torch.tensor(_FIRST, dtype=torch.float64) / h[axis])
        else:
            factors.append(torch.tensor(_SECOND, dtype=torch.float64) / h[axis] ** 2)
    return torch.einsum("a,b,c->abc", *factors)


def _pad_axis_cubic(u: torch.Tensor, dim: int) -> torch.Tensor:
    """One cubic ghost node on each side of axis ``dim`` (the 1-D rule of ``pad_cubic``)."""
    n = u.shape[dim]
    lo = sum(a * u.narrow(dim, k, 1) for k, a in enumerate(_GHOST))
    hi = sum(a * u.narrow(dim, n - 1 - k, 1) for k, a in enumerate(_GHOST))
    return torch.cat([lo, u, hi], dim=dim)


def pad_cubic_3d(u: torch.Tensor) -> torch.Tensor:
    """Pad (B, C, D, H, W) by one cubic ghost node per side -> (B, C, D+2, H+2, W+2).

    Depth first, then rows, then columns, each axis reading the ghosts the previous ones wrote,
    so edge and corner ghosts are extrapolated along every axis (exact on polynomials of degree
    <= 3 in each variable, error O(h^4)).
    """
    for dim in (2, 3, 4):
        u = _pad_axis_cubic(u, dim)
    return u


class FiniteDifference3D(FiniteDifference):
    """Derivatives of a (B, 1, D, H, W) field on the node grid, in one conv3d pass.

    Args:
        spacing: (h_depth, h_row, h_col) node spacing, each axis its own (positive).
        kind: one of ``KINDS``: central differences smoothed across the other two axes (see
            the module docstring, 3-D); second order.
        derivatives: names from ``DERIVATIVES_3D``; output channel k is ``derivatives[k]``.

    forward(u, block=None): (B, 1, D, H, W) with D, H, W >= 4 -> (B, len(derivatives), D, H, W),
    values on every node including the boundary (cubic ghost nodes); on a split ``block`` the
    block's part, as in ``FiniteDifference``. Kernels: a float64 buffer, cast to the input's
    dtype/device in forward, as in ``FiniteDifference``.
    """

    dims = 3
    conv = "conv3d"
    pad_whole = staticmethod(pad_cubic_3d)

    def __init__(self, spacing, kind: str = "sobel", derivatives=("d", "r", "c")):
        torch.nn.Module.__init__(self)  # its own kernels; index() is the 2-D class's
        self.spacing = check_positive_tuple("spacing", spacing, 3, SPACING_3D)
        self.kind = check_choice("kind", kind, KINDS)
        self.derivatives = _check_derivatives(derivatives, DERIVATIVES_3D)
        weight = torch.stack([stencil_kernel_3d(d, self.spacing, self.kind)
                              for d in self.derivatives])
        self.register_buffer("weight", weight.unsqueeze(1), persistent=False)   # (K, 1, 3, 3, 3)
