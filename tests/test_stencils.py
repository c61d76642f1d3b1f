"""diffnet.stencils: exactness on polynomials, order of accuracy, argument checks, one conv;
the same class on 1-D grids (whole and split) and its docstring examples."""
from __future__ import annotations

import doctest

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from diffnet import stencils
from diffnet.problems.check.split import ThreadSplit, run_blocks
from diffnet.stencils import KINDS, FiniteDifference, derivative_names, gradient, pad_cubic

ALL = ("r", "c", "rr", "cc", "rc")
# A non-square domain: rows on [0, 1/3], columns on [-0.5, 1] (as Burgers' (t, x) grids are).
ROW_LO, ROW_HI, COL_LO, COL_HI = 0.0, 1.0 / 3.0, -0.5, 1.0


def grid(h, w, dtype=torch.float64):
    """Row coordinates (H, 1), column coordinates (1, W), spacing (h_row, h_col)."""
    y = torch.linspace(ROW_LO, ROW_HI, h, dtype=dtype)[:, None]
    x = torch.linspace(COL_LO, COL_HI, w, dtype=dtype)[None, :]
    return y, x, ((ROW_HI - ROW_LO) / (h - 1), (COL_HI - COL_LO) / (w - 1))


def field(f):
    """(H, W) -> (1, 1, H, W)."""
    return f[None, None]


def check_exact(kind, u, exact, spacing, names, tol=1e-9):
    d = FiniteDifference(spacing, kind, names)(field(u))
    assert d.shape == (1, len(names), *u.shape)
    for k, name in enumerate(names):
        ref = torch.broadcast_to(exact[name], u.shape)
        scale = 1.0 + ref.abs().max().item()
        err = (d[0, k] - ref).abs().max().item()
        assert err <= tol * scale, f"{kind} {name}: max error {err:.3e} on the whole grid"


@pytest.mark.parametrize("kind", KINDS)
def test_exact_on_quadratics_whole_grid(kind):
    y, x, sp = grid(7, 11)
    u = 1.5 - 2 * y + 3 * x + 4 * y * y - 5 * x * y + 0.7 * x * x
    exact = {"r": -2 + 8 * y - 5 * x, "c": 3 - 5 * y + 1.4 * x,
             "rr": torch.tensor(8.0, dtype=u.dtype), "cc": torch.tensor(1.4, dtype=u.dtype),
             "rc": torch.tensor(-5.0, dtype=u.dtype)}
    check_exact(kind, u, exact, sp, ALL)


@pytest.mark.parametrize("kind", KINDS)
def test_exact_on_linear(kind):
    y, x, sp = grid(4, 5)  # the smallest allowed grid: every node is a boundary stencil
    u = 0.3 + 2 * y - 7 * x
    exact = {"r": torch.tensor(2.0, dtype=u.dtype), "c": torch.tensor(-7.0, dtype=u.dtype),
             "rr": torch.tensor(0.0, dtype=u.dtype), "cc": torch.tensor(0.0, dtype=u.dtype),
             "rc": torch.tensor(0.0, dtype=u.dtype)}
    check_exact(kind, u, exact, sp, ALL)


@pytest.mark.parametrize("kind", KINDS)
def test_second_derivatives_exact_on_cubics(kind):
    """Second and mixed derivatives are exact on total degree <= 3, corners included."""
    y, x, sp = grid(8, 6)
    u = (y**3 - 2 * x**3 + 3 * x**2 * y - y**2 * x + x * y + y**2)
    exact = {"rr": 6 * y - 2 * x + 2, "cc": -12 * x + 6 * y, "rc": 6 * x - 2 * y + 1}
    check_exact(kind, u, exact, sp, ("rr", "cc", "rc"))


def test_central_exact_on_tensor_cubics():
    """central: first derivative exact on (deg 2 along) x (deg 3 across), second on (3) x (3)."""
    y, x, sp = grid(6, 9)
    u = (y**2 + y) * (x**3 - x)
    check_exact("central", u, {"r": (2 * y + 1) * (x**3 - x)}, sp, ("r",))
    u = (y**3 - 2 * y) * (x**3 + x**2)
    check_exact("central", u, {"rr": 6 * y * (x**3 + x**2)}, sp, ("rr",))
    u = (x**2 + x) * (y**3 - y)
    check_exact("central", u, {"c": (2 * x + 1) * (y**3 - y)}, sp, ("c",))


def test_boundary_stencils_match_documented_one_sided_formulas():
    u = torch.randn(1, 1, 6, 7, dtype=torch.float64)
    h_r, h_c = 0.1, 0.3
    d = FiniteDifference((h_r, h_c), "central", ("r", "rr", "c", "cc"))(u)[0]
    v = u[0, 0]
    r0 = (-4 * v[0] + 7 * v[1] - 4 * v[2] + v[3]) / (2 * h_r)
    rr0 = (2 * v[0] - 5 * v[1] + 4 * v[2] - v[3]) / h_r**2
    rlast = -(-4 * v[-1] + 7 * v[-2] - 4 * v[-3] + v[-4]) / (2 * h_r)
    c0 = (-4 * v[:, 0] + 7 * v[:, 1] - 4 * v[:, 2] + v[:, 3]) / (2 * h_c)
    cc0 = (2 * v[:, 0] - 5 * v[:, 1] + 4 * v[:, 2] - v[:, 3]) / h_c**2
    for got, ref in ((d[0, 0], r0), (d[1, 0], rr0), (d[0, -1], rlast), (d[2][:, 0], c0),
                     (d[3][:, 0], cc0)):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-10)


def smooth_case(n):
    """u = sin(2y + 1) exp(x) cos(x) with all its derivatives, on an n x (2n) non-square grid."""
    y, x, sp = grid(n, 2 * n)
    s, cy = torch.sin(2 * y + 1), torch.cos(2 * y + 1)
    e = torch.exp(x) * torch.cos(x)
    ex = torch.exp(x) * (torch.cos(x) - torch.sin(x))       # d/dx of e^x cos x
    ex2 = -2 * torch.exp(x) * torch.sin(x)                   # d2/dx2
    exact = {"r": 2 * cy * e, "c": s * ex, "rr": -4 * s * e, "cc": s * ex2, "rc": 2 * cy * ex}
    return s * e, exact, sp


@pytest.mark.parametrize("kind", KINDS)
def test_order_of_accuracy_max_norm_whole_grid(kind):
    sizes = (17, 33, 65)
    errs = {name: [] for name in ALL}
    hs = []
    for n in sizes:
        u, exact, sp = smooth_case(n)
        d = FiniteDifference(sp, kind, ALL)(field(u))[0]
        hs.append(sp[0])
        for k, name in enumerate(ALL):
            errs[name].append((d[k] - exact[name]).abs().max().item())
    for name in ALL:
        slopes = np.diff(np.log(errs[name])) / np.diff(np.log(hs))
        assert 1.8 <= slopes[-1] <= 2.2, f"{kind} {name}: errors {errs[name]}, slopes {slopes}"


def test_kinds_match_documented_kernels():
    h_r, h_c = 0.5, 0.25
    s3 = stencils.stencil_kernel("r", (h_r, h_c), "sobel3103")
    ref = torch.tensor([[-3, -10, -3], [0, 0, 0], [3, 10, 3]], dtype=torch.float64) / (32 * h_r)
    torch.testing.assert_close(s3, ref)
    torch.testing.assert_close(stencils.stencil_kernel("c", (h_r, h_c), "sobel3103"),
                               ref.T * h_r / h_c)
    sob = stencils.stencil_kernel("r", (h_r, h_c), "sobel")
    torch.testing.assert_close(sob, torch.tensor([[-1, -2, -1], [0, 0, 0], [1, 2, 1]],
                                                 dtype=torch.float64) / (8 * h_r))
    cen = stencils.stencil_kernel("cc", (h_r, h_c), "central")
    torch.testing.assert_close(cen, torch.tensor([[0, 0, 0], [1, -2, 1], [0, 0, 0]],
                                                 dtype=torch.float64) / h_c**2)


def test_one_conv2d_call_for_all_derivatives(monkeypatch):
    calls = []
    real = F.conv2d

    def counting(*args, **kwargs):
        calls.append(args[1].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(stencils.F, "conv2d", counting)
    fd = FiniteDifference((0.1, 0.2), "sobel", ALL)
    out = fd(torch.randn(3, 1, 8, 10))
    assert out.shape == (3, 5, 8, 10)
    assert len(calls) == 1 and tuple(calls[0]) == (5, 1, 3, 3)


def test_kernels_are_buffers_following_dtype_not_parameters():
    fd = FiniteDifference((0.1, 0.2))
    assert list(fd.parameters()) == []
    assert fd.weight.dtype == torch.float64
    fd32 = fd.to(torch.float32)
    assert fd32.weight.dtype == torch.float32 and not fd32.weight.requires_grad


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
def test_dtypes_and_channels_last(dtype):
    u = torch.randn(2, 1, 8, 12, dtype=dtype)
    fd = FiniteDifference((0.1, 0.05), "sobel3103", ALL)
    ref = fd(u)
    assert ref.dtype == dtype
    got = fd(u.to(memory_format=torch.channels_last))
    torch.testing.assert_close(got, ref)
    # A genuinely non-contiguous view (a strided slice) works too.
    big = torch.randn(2, 1, 16, 24, dtype=dtype)
    torch.testing.assert_close(fd(big[:, :, ::2, ::2]), fd(big[:, :, ::2, ::2].contiguous()))


def test_gradients_flow_through_padding():
    u = torch.randn(1, 1, 5, 6, dtype=torch.float64, requires_grad=True)
    fd = FiniteDifference((0.3, 0.2), "sobel", ALL)
    assert torch.autograd.gradcheck(fd, (u,))


def test_pad_cubic_exact_on_bicubic():
    y, x, _ = grid(5, 6)
    f = lambda yy, xx: (yy**3 - yy) * (xx**3 + 2 * xx**2) + yy * xx  # noqa: E731
    hr, hc = (ROW_HI - ROW_LO) / 4, (COL_HI - COL_LO) / 5
    yp = torch.linspace(ROW_LO - hr, ROW_HI + hr, 7, dtype=torch.float64)[:, None]
    xp = torch.linspace(COL_LO - hc, COL_HI + hc, 8, dtype=torch.float64)[None, :]
    torch.testing.assert_close(pad_cubic(field(f(y, x)))[0, 0], f(yp, xp))


def test_gradient_helper():
    y, x, sp = grid(6, 7)
    dr, dc = gradient(field(3 * y - 2 * x + y * x), sp, kind="central")
    assert dr.shape == dc.shape == (1, 1, 6, 7)
    torch.testing.assert_close(dr[0, 0], (3 + x).expand(6, 7))
    torch.testing.assert_close(dc[0, 0], (-2 + y).expand(6, 7))


@pytest.mark.parametrize("kwargs, name", [
    (dict(spacing=()), "spacing"),
    (dict(spacing=(0.1, 0.1, 0.1, 0.1)), "spacing"),
    (dict(spacing=(0.1,), derivatives=("r",)), "derivatives"),
    (dict(spacing=(0.1, -0.2)), "spacing"),
    (dict(spacing=(0.1, float("nan"))), "spacing"),
    (dict(spacing="ab"), "spacing"),
    (dict(spacing=(0.1, 0.1), kind="scharr"), "kind"),
    (dict(spacing=(0.1, 0.1), derivatives=()), "derivatives"),
    (dict(spacing=(0.1, 0.1), derivatives=("r", "xx")), "derivatives"),
    (dict(spacing=(0.1, 0.1), derivatives=("r", "r")), "derivatives"),
    (dict(spacing=(0.1, 0.1), derivatives="rr"), "derivatives"),
    (dict(spacing=(0.1, 0.1), derivatives=3), "derivatives"),
])
def test_bad_arguments_raise_value_error_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        FiniteDifference(**kwargs)


def test_bad_inputs_raise():
    fd = FiniteDifference((0.1, 0.1))
    with pytest.raises(ValueError, match="at least 4 nodes"):
        fd(torch.zeros(1, 1, 3, 8))
    with pytest.raises(ValueError, match=r"\(B, 1, H, W\)"):
        fd(torch.zeros(1, 2, 8, 8))
    with pytest.raises(ValueError, match=r"\(B, 1, H, W\)"):
        fd(torch.zeros(8, 8))
    with pytest.raises(ValueError, match="floating"):
        fd(torch.zeros(1, 1, 8, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="name"):
        fd.index("rc")
    assert fd.index("cc") == 3


def test_docstring_examples_run():
    result = doctest.testmod(stencils, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_derivative_names_per_dimension():
    assert derivative_names(1) == ("c", "cc")
    assert derivative_names(2) == ("r", "c", "rr", "cc", "rc")
    assert derivative_names(3) == ("d", "r", "c", "dd", "rr", "cc", "dr", "dc", "rc")
    assert FiniteDifference((0.1,)).derivatives == ("c", "cc")
    assert FiniteDifference((0.1, 0.2)).derivatives == ("r", "c", "rr", "cc")


@pytest.mark.parametrize("kind", KINDS)
def test_one_axis_exact_on_cubics_with_one_conv1d(kind, monkeypatch):
    """1-D: no transverse axis, so every kind is the central stencil; u' exact on quadratics,
    u'' on cubics, boundary nodes included."""
    calls = []
    real = F.conv1d
    monkeypatch.setattr(stencils.F, "conv1d", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.linspace(-0.5, 1.0, 9, dtype=torch.float64)
    h = 1.5 / 8
    d = FiniteDifference((h,), kind, ("c", "cc"))((x**3 - 2 * x**2 + x)[None, None])[0]
    torch.testing.assert_close(d[1], 6 * x - 4)
    d = FiniteDifference((h,), kind, ("c",))((3 * x**2 - x)[None, None])[0]
    torch.testing.assert_close(d[0], 6 * x - 1)
    assert calls == []      # float64: shifted views (valid_convolution), not ATen's im2col
    FiniteDifference((h,), kind, ("c", "cc"))(x[None, None].float())
    assert len(calls) == 1


@pytest.mark.parametrize("shape", [(3, 2, 9), (2, 2, 7, 8), (2, 1, 5, 6, 7)])
def test_float64_valid_convolution_is_atens(shape):
    """The float64 shifted-view sum equals ATen's convolution to rounding, dense kernels and
    several input channels included."""
    dims = len(shape) - 2
    p = torch.randn(shape, dtype=torch.float64)
    w = torch.randn((4, shape[1]) + (3,) * dims, dtype=torch.float64)
    w[0, 0].zero_()
    want = getattr(F, f"conv{dims}d")(p, w)
    torch.testing.assert_close(stencils.valid_convolution(p, w), want, rtol=1e-13, atol=1e-13)


def test_one_axis_on_blocks_is_the_undivided_one():
    u = torch.randn((2, 1, 16), dtype=torch.float64)
    fd = FiniteDifference((0.1,), "sobel", ("c", "cc"))
    ts = ThreadSplit((16,), [2])
    blocks, parts = run_blocks(ts, lambda b: fd(b.local(u), b))
    got = ts.assemble({b.coord: r for b, r in zip(blocks, parts)}, 2)
    torch.testing.assert_close(got, fd(u), rtol=1e-12, atol=1e-9)


def test_gradient_helper_any_dimension():
    u = torch.randn((1, 1, 5, 6, 7), dtype=torch.float64)
    parts = gradient(u, (0.1, 0.2, 0.3), kind="central")
    want = FiniteDifference((0.1, 0.2, 0.3), "central", ("d", "r", "c"))(u)
    assert len(parts) == 3 and all(torch.equal(p, want[:, k:k + 1]) for k, p in enumerate(parts))


@pytest.mark.parametrize("shape", [(2, 1, 7), (2, 1, 6, 5), (1, 1, 4, 5, 6)])
def test_stencil_backward_is_the_convolutions_gradient(shape):
    """StencilConv's backward (a forward convolution by the flipped kernels) gives the gradient
    autograd gives through the plain convolution, and is itself differentiable (gradcheck and
    gradgradcheck in float64)."""
    dims = len(shape) - 2
    spacing = (0.1, 0.2, 0.3)[:dims]
    fd = FiniteDifference(spacing, "sobel")
    u = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    g = torch.randn(fd(u).shape, dtype=torch.float64)
    (ours,) = torch.autograd.grad(fd(u), u, g)
    plain = getattr(F, f"conv{dims}d")(stencils.pad_cubic(u), fd.weight)
    (ref,) = torch.autograd.grad(plain, u, g)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-9)
    small = torch.randn((1, 1) + (4,) * dims, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fd, (small,))
    assert torch.autograd.gradgradcheck(fd, (small,))
