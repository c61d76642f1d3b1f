"""diffnet.stencils, 3-D: the conv3d stencils' exactness on polynomials (boundaries and corners
included), documented kernels and one-sided closures, observed second order in float64,
agreement with the 2-D stencils on fields constant in depth, one conv, argument checks."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from diffnet import stencils
from diffnet.stencils import KINDS, FiniteDifference, derivative_names, pad_cubic, stencil_kernel

F64 = torch.float64
ALL_3D = derivative_names(3)
# A non-cubic box with its own spacing per axis: depth [0, 1/2], rows [0, 1/3], columns [-0.5, 1].
BOX = ((0.0, 0.5), (0.0, 1.0 / 3.0), (-0.5, 1.0))


def grid(d, h, w):
    """Coordinates z (D,1,1), y (1,H,1), x (1,1,W) and the spacing (h_d, h_r, h_c)."""
    z, y, x = (torch.linspace(lo, hi, n, dtype=F64) for (lo, hi), n in zip(BOX, (d, h, w)))
    sp = tuple((hi - lo) / (n - 1) for (lo, hi), n in zip(BOX, (d, h, w)))
    return z[:, None, None], y[None, :, None], x[None, None, :], sp


def check_exact(kind, u, exact, spacing, tol=1e-9):
    """Every derivative in ``exact`` on every node, to ``tol`` relative to 1 + max |exact|
    (float64 rounding of O(1/h^2) kernel weights times O(1) values stays far below 1e-9)."""
    names = tuple(exact)
    d = FiniteDifference(spacing, kind, names)(u[None, None])
    assert d.shape == (1, len(names), *u.shape)
    for k, name in enumerate(names):
        ref = torch.broadcast_to(torch.as_tensor(exact[name], dtype=F64), u.shape)
        err = (d[0, k] - ref).abs().max().item()
        assert err <= tol * (1.0 + ref.abs().max().item()), f"{kind} {name}: max error {err:.3e}"


@pytest.mark.parametrize("kind", KINDS)
def test_every_derivative_exact_on_quadratics_whole_grid(kind):
    z, y, x, sp = grid(6, 7, 5)
    u = (1 + 2 * z - y + 3 * x + 0.5 * z * z - 2 * y * y + 0.7 * x * x
         + 1.5 * z * y - 0.8 * z * x + 2.5 * y * x)
    exact = {"d": 2 + z + 1.5 * y - 0.8 * x, "r": -1 - 4 * y + 1.5 * z + 2.5 * x,
             "c": 3 + 1.4 * x - 0.8 * z + 2.5 * y, "dd": 1.0, "rr": -4.0, "cc": 1.4,
             "dr": 1.5, "dc": -0.8, "rc": 2.5}
    check_exact(kind, u, exact, sp)


@pytest.mark.parametrize("kind", KINDS)
def test_second_and_mixed_derivatives_exact_on_cubics(kind):
    """Total degree <= 3, corners and edges included (the ghost closure is cubic)."""
    z, y, x, sp = grid(5, 6, 7)
    u = z**3 - 2 * y**3 + x**3 + z * y * x + 3 * z * z * x - y * y * z + 2 * x * x * y + z * y
    exact = {"dd": 6 * z + 6 * x, "rr": -12 * y - 2 * z, "cc": 6 * x + 4 * y,
             "dr": x - 2 * y + 1, "dc": y + 6 * z, "rc": z + 4 * x}
    check_exact(kind, u, exact, sp)


def test_central_exact_on_tensor_products():
    """central has no smoothing: d/dc is exact on p(x) q(y) r(z) with deg p <= 2 and any cubic
    q, r (the ghosts along y, z are exact on cubics); d2/dc2 with deg p <= 3."""
    z, y, x, sp = grid(5, 6, 7)
    q = (y**3 - y) * (z**3 + 2 * z**2 - 1)
    check_exact("central", (x**2 + x) * q, {"c": (2 * x + 1) * q}, sp)
    check_exact("central", (x**3 - 2 * x) * q, {"cc": 6 * x * q}, sp)


def test_documented_kernels():
    h = (0.5, 0.25, 0.2)
    s = torch.tensor([1.0, 2.0, 1.0], dtype=F64)
    dif = torch.tensor([-1.0, 0.0, 1.0], dtype=F64)
    # sobel "c": the 3-D Sobel operator, [1,2,1] x [1,2,1] x [-1,0,1] / (32 h_c)
    want = torch.einsum("a,b,c->abc", s, s, dif) / (32 * h[2])
    torch.testing.assert_close(stencil_kernel("c", h, "sobel"), want, rtol=1e-15, atol=0)
    # sobel3103 "d": [3,10,3] / 16 across rows and columns
    s3 = torch.tensor([3.0, 10.0, 3.0], dtype=F64) / 16
    want = torch.einsum("a,b,c->abc", dif / (2 * h[0]), s3, s3)
    torch.testing.assert_close(stencil_kernel("d", h, "sobel3103"), want, rtol=1e-15, atol=0)
    # central "rr": the plain second difference along rows, nothing across
    want = torch.zeros(3, 3, 3, dtype=F64)
    want[1, :, 1] = torch.tensor([1.0, -2.0, 1.0], dtype=F64) / h[1] ** 2
    torch.testing.assert_close(stencil_kernel("rr", h, "central"), want, rtol=1e-15, atol=0)
    # sobel "dr": mixed difference, smoothed along the third axis (columns)
    want = torch.einsum("a,b,c->abc", dif / (2 * h[0]), dif / (2 * h[1]), s / 4)
    torch.testing.assert_close(stencil_kernel("dr", h, "sobel"), want, rtol=1e-15, atol=0)


def test_boundary_stencils_are_the_documented_one_sided_formulas():
    g = torch.Generator().manual_seed(0)
    u = torch.randn(1, 1, 6, 5, 7, dtype=F64, generator=g)
    h = (0.1, 0.3, 0.2)
    d = FiniteDifference(h, "central", ("d", "dd", "c", "cc"))(u)[0]
    v = u[0, 0]
    torch.testing.assert_close(d[0, 0], (-4 * v[0] + 7 * v[1] - 4 * v[2] + v[3]) / (2 * h[0]))
    torch.testing.assert_close(d[1, -1], (2 * v[-1] - 5 * v[-2] + 4 * v[-3] - v[-4]) / h[0]**2)
    c = v[..., :4]
    torch.testing.assert_close(d[2, ..., 0], (-4 * c[..., 0] + 7 * c[..., 1] - 4 * c[..., 2]
                                              + c[..., 3]) / (2 * h[2]))
    torch.testing.assert_close(d[3, ..., 0], (2 * c[..., 0] - 5 * c[..., 1] + 4 * c[..., 2]
                                              - c[..., 3]) / h[2]**2)


@pytest.mark.parametrize("kind", KINDS)
def test_fields_constant_in_depth_get_the_2d_derivatives(kind):
    """The smoothing weights sum to 1, so on u(y, x) the 3-D r, c, rr, cc, rc are the 2-D ones
    (the mixed one too: smoothing a depth-constant field along depth changes nothing)."""
    g = torch.Generator().manual_seed(1)
    plane = torch.randn(1, 1, 6, 8, dtype=F64, generator=g)
    u = plane[:, :, None].expand(1, 1, 5, 6, 8).contiguous()
    names = ("r", "c", "rr", "cc", "rc")
    d3 = FiniteDifference((0.7, 0.2, 0.3), kind, names + ("d", "dd", "dr"))(u)
    d2 = FiniteDifference((0.2, 0.3), kind, names)(plane)
    for k in range(5):
        torch.testing.assert_close(d3[:, k], d2[:, k, None].expand(1, 5, 6, 8),
                                   rtol=1e-12, atol=1e-10)
    assert d3[:, 5:].abs().max() < 1e-9  # no depth derivatives


def smooth_case(n):
    """u = sin(2z + 1) cos(3y) e^x cos x and its derivatives on an n x n x 2n box grid."""
    z, y, x, sp = grid(n, n, 2 * n)
    a, da, dda = torch.sin(2 * z + 1), 2 * torch.cos(2 * z + 1), -4 * torch.sin(2 * z + 1)
    b, db, ddb = torch.cos(3 * y), -3 * torch.sin(3 * y), -9 * torch.cos(3 * y)
    c = torch.exp(x) * torch.cos(x)
    dc = torch.exp(x) * (torch.cos(x) - torch.sin(x))
    ddc = -2 * torch.exp(x) * torch.sin(x)
    exact = {"d": da * b * c, "r": a * db * c, "c": a * b * dc, "dd": dda * b * c,
             "rr": a * ddb * c, "cc": a * b * ddc, "dr": da * db * c, "dc": da * b * dc,
             "rc": a * db * dc}
    return a * b * c, exact, sp


@pytest.mark.parametrize("kind", KINDS)
def test_second_order_max_norm_whole_grid(kind):
    """Max error over every node (faces, edges, corners included) falls like h^2: the observed
    order between the two finest grids is in [1.8, 2.2] for every derivative (2-D's bound)."""
    errs = {name: [] for name in ALL_3D}
    hs = []
    for n in (9, 17, 33):
        u, exact, sp = smooth_case(n)
        d = FiniteDifference(sp, kind, ALL_3D)(u[None, None])[0]
        hs.append(sp[0])
        for k, name in enumerate(ALL_3D):
            errs[name].append((d[k] - exact[name]).abs().max().item())
    for name in ALL_3D:
        slopes = np.diff(np.log(errs[name])) / np.diff(np.log(hs))
        assert 1.8 <= slopes[-1] <= 2.2, f"{kind} {name}: errors {errs[name]}, slopes {slopes}"


def test_pad_cubic_exact_on_tricubics():
    z, y, x, sp = grid(5, 4, 6)

    def f(zz, yy, xx):
        return (zz**3 - zz) * (yy**3 + yy**2) * (xx**3 - 2 * xx) + zz * yy * xx + yy**2

    zp, yp, xp = (torch.linspace(lo - h, hi + h, n + 2, dtype=F64)
                  for (lo, hi), h, n in zip(BOX, sp, (5, 4, 6)))
    torch.testing.assert_close(pad_cubic(f(z, y, x)[None, None])[0, 0],
                               f(zp[:, None, None], yp[None, :, None], xp[None, None, :]))


def test_one_conv3d_call_for_all_derivatives(monkeypatch):
    calls = []
    real = F.conv3d

    def counting(*args, **kwargs):
        calls.append(tuple(args[1].shape))
        return real(*args, **kwargs)

    monkeypatch.setattr(stencils.F, "conv3d", counting)
    out = FiniteDifference((0.1, 0.2, 0.3), "sobel", ALL_3D)(torch.randn(2, 1, 5, 6, 7))
    assert out.shape == (2, 9, 5, 6, 7)
    assert calls == [(9, 1, 3, 3, 3)]


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
def test_dtypes_channels_last_3d_and_buffers(dtype):
    fd = FiniteDifference((0.1, 0.05, 0.2), "sobel3103", ALL_3D)
    assert list(fd.parameters()) == [] and fd.weight.dtype == F64
    u = torch.randn(2, 1, 6, 8, 7, dtype=dtype)
    ref = fd(u)
    assert ref.dtype == dtype
    torch.testing.assert_close(fd(u.contiguous(memory_format=torch.channels_last_3d)), ref)
    big = torch.randn(2, 1, 12, 16, 14, dtype=dtype)
    view = big[..., ::2, ::2, ::2]
    torch.testing.assert_close(fd(view), fd(view.contiguous()))


def test_gradients_flow_through_the_padding():
    u = torch.randn(1, 1, 4, 5, 4, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(FiniteDifference((0.3, 0.2, 0.4), "sobel",
                                                       ("d", "cc", "rc")), (u,))


@pytest.mark.parametrize("kwargs, name", [
    (dict(spacing=(0.1,) * 4), "spacing"),
    (dict(spacing=(0.1, -0.2, 0.1)), "spacing"),
    (dict(spacing=(0.1, float("inf"), 0.1)), "spacing"),
    (dict(spacing="abc"), "spacing"),
    (dict(spacing=(0.1,) * 3, kind="scharr"), "kind"),
    (dict(spacing=(0.1,) * 3, derivatives=()), "derivatives"),
    (dict(spacing=(0.1,) * 3, derivatives=("r", "zz")), "derivatives"),
    (dict(spacing=(0.1,) * 3, derivatives=("d", "d")), "derivatives"),
    (dict(spacing=(0.1,) * 3, derivatives="dd"), "derivatives"),
])
def test_bad_arguments_name_the_argument_and_the_valid_values(kwargs, name):
    with pytest.raises(ValueError, match=name) as e:
        FiniteDifference(**kwargs)
    if name == "kind":
        assert str(KINDS) in str(e.value)
    if name == "spacing":
        assert "(h_depth, h_row, h_col)" in str(e.value)


def test_bad_inputs_are_refused():
    fd = FiniteDifference((0.1, 0.1, 0.1))
    with pytest.raises(ValueError, match="at least 4 nodes"):
        fd(torch.zeros(1, 1, 8, 3, 8))
    with pytest.raises(ValueError, match=r"\(B, 1, D, H, W\)"):
        fd(torch.zeros(1, 1, 8, 8))
    with pytest.raises(ValueError, match=r"\(B, 1, D, H, W\)"):
        fd(torch.zeros(1, 2, 8, 8, 8))
    with pytest.raises(ValueError, match="floating"):
        fd(torch.zeros(1, 1, 4, 4, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="computed derivatives"):
        fd.index("rc")
    assert fd.index("c") == 2
    with pytest.raises(ValueError, match="derivative name"):
        stencil_kernel("x", (0.1, 0.1, 0.1))
