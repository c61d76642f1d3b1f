"""The 3x3 convolutions by Winograd's F(2x2, 3x3) (diffnet.kernels.winograd): values and both
gradients against a float64 reference at float32 rounding, on the AVX-512 and the AVX2 build,
independent of the thread count, NaN reaching the output, oneDNN wherever the kernel does not
apply, and the fused network against the eager one."""
import ctypes
import subprocess

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from diffnet.generators import UNet
from diffnet.kernels import WinogradConv2d, build, fuse, fuse_winograd, winograd
from tests.test_fused_kernels import channels_last, needs_gcc

pytestmark = needs_gcc

# (batch, cin, cout, h, w): the U-Net's channel pairs, a partial last block of tiles (60 x 4
# tiles is 5 blocks of 48), non-square fields, and the weight gradient's partial sums
SHAPES = [(2, 16, 16, 8, 8), (1, 32, 16, 8, 12), (3, 48, 16, 10, 10), (2, 16, 64, 8, 8),
          (2, 256, 128, 8, 8), (1, 32, 32, 32, 32), (60, 16, 16, 8, 8), (2, 96, 32, 64, 16)]


def relative(a, ref):
    return float((a.detach().double() - ref).norm() / ref.detach().norm())


def reference(n, cin, cout, h, w, bias, seed=0):
    """float64 inputs, the float64 convolution's value and gradients, and the upstream g."""
    torch.manual_seed(seed)
    x = torch.randn(n, cin, h, w, dtype=torch.float64, requires_grad=True)
    wt = (torch.randn(cout, cin, 3, 3, dtype=torch.float64) / (3 * cin ** 0.5)).requires_grad_()
    b = torch.randn(cout, dtype=torch.float64, requires_grad=True) if bias else None
    y = F.conv2d(x, wt, b, padding=1)
    g = torch.randn_like(y)
    y.backward(g)
    return (x, wt, b, g), (y, x.grad, wt.grad, None if b is None else b.grad)


def through(fn, x, wt, b, g):
    xf = channels_last(x.detach().float()).requires_grad_()
    wf = wt.detach().float().requires_grad_()
    bf = None if b is None else b.detach().float().requires_grad_()
    y = fn(xf, wf, bf)
    y.backward(channels_last(g.float()))
    return y, xf.grad, wf.grad, None if b is None else bf.grad


def kernel(x, w, b):
    assert winograd.takes(x, w)
    return winograd.WinogradConv.apply(x, w, b)


@pytest.mark.parametrize("n,cin,cout,h,w", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_values_and_gradients_at_float32_rounding(n, cin, cout, h, w, bias):
    inputs, ref = reference(n, cin, cout, h, w, bias)
    got = through(kernel, *inputs)
    onednn = through(lambda x, w, b: F.conv2d(x, w, b, padding=1), *inputs)
    assert got[0].is_contiguous(memory_format=torch.channels_last)
    for a, r, o in zip(got, ref, onednn):
        if r is not None:  # within 4x oneDNN's own error, and 1e-6 at worst
            assert relative(a, r) < max(4 * relative(o, r), 1e-6)


def test_no_result_depends_on_the_thread_count():
    inputs, _ = reference(8, 32, 64, 16, 16, bias=True)
    before = torch.get_num_threads()
    outs = []
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(through(kernel, *inputs))
    finally:
        torch.set_num_threads(before)
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))


def test_a_nan_reaches_the_output_and_the_weight_gradient():
    (x, wt, b, g), _ = reference(2, 16, 16, 8, 8, bias=False)
    with torch.no_grad():
        x[1, 3, 4, 5] = float("nan")
    y, gx, gw, _ = through(kernel, x, wt, b, g)
    assert y[1].isnan().any() and not y[0].isnan().any()
    assert gw.isnan().any() and not gx[0].isnan().any()


@pytest.mark.parametrize("x,why", [
    (torch.randn(1, 16, 8, 8), "NCHW"),
    (channels_last(torch.randn(1, 16, 8, 8)).double(), "float64"),
    (channels_last(torch.randn(1, 8, 8, 8)), "8 input channels"),
    (channels_last(torch.randn(1, 16, 9, 8)), "an odd side"),
    (channels_last(torch.randn(1, 16, 4, 4)), "a side under 8"),
])
def test_other_calls_run_onednn(x, why):
    conv = nn.Conv2d(x.shape[1], 16, 3, padding=1, bias=False).to(x.dtype)
    plain = nn.Conv2d(x.shape[1], 16, 3, padding=1, bias=False).to(x.dtype)
    plain.load_state_dict(conv.state_dict())
    fuse_winograd(conv)
    assert not winograd.takes(x, conv.weight), why
    assert torch.equal(conv(x), plain(x))


def test_under_autocast_and_tracing_onednn_runs():
    conv = nn.Conv2d(16, 16, 3, padding=1)
    fuse_winograd(conv)
    x = channels_last(torch.randn(1, 16, 8, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not winograd.takes(x, conv.weight)
    traced = torch.jit.trace(conv, x)
    graph = str(traced.graph)
    assert "PythonOp" not in graph and "aten::_convolution" in graph
    torch.testing.assert_close(traced(x), conv(x))


def net(**kw):
    torch.manual_seed(0)
    return UNet(in_channels=1, depth=2, **kw).to(memory_format=torch.channels_last)


def test_fuse_swaps_the_3x3_stride_1_convolutions_and_keeps_the_state_dict():
    plain, fused = net(), net()
    swapped = fuse_winograd(fused)
    convs = [m for m in fused.modules() if isinstance(m, WinogradConv2d)]
    assert swapped == len(convs) == 9  # all but the first layer's (1 input channel)
    assert all(m.kernel_size == (3, 3) and m.stride == (1, 1) for m in convs)
    assert list(fused.state_dict()) == list(plain.state_dict())
    assert fuse_winograd(fused) == 0  # already fused
    assert fuse_winograd(net(base_width=4)) == 1  # widths 4, 8, 16: only 16 -> 16 qualifies
    small = nn.Sequential(nn.Conv2d(16, 16, 3, stride=2, padding=1), nn.Conv2d(16, 16, 1),
                          nn.Conv2d(16, 16, 3, padding=2, dilation=2))
    assert fuse_winograd(small) == 0


def test_the_fused_network_trains_the_eager_function():
    """All kernels in: the output and every parameter gradient to float32 rounding."""
    plain, fused = net(), net()
    fuse(fused)
    x = channels_last(torch.rand(4, 1, 32, 32))
    for m in (plain, fused):
        m(x).square().mean().backward()
    torch.testing.assert_close(fused(x), plain(x), rtol=1e-4, atol=1e-5)
    for a, b in zip(plain.parameters(), fused.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-3, atol=1e-6)


def cpu_has(flag: str) -> bool:
    return flag in build.cpu_flags().split()


@pytest.mark.skipif(not cpu_has("avx2") or not cpu_has("fma"), reason="needs an AVX2 CPU")
def test_the_avx2_build_computes_the_same_convolution(tmp_path):
    """The 16-register blocking (the build on an AVX2-only host), built for Haswell here."""
    so = tmp_path / "winograd_avx2.so"
    flags = [f if f != "-march=native" else "-march=haswell" for f in build.FLAGS]
    subprocess.run([build.compiler(), *flags, "-o", str(so), str(build.HERE / "winograd.c")],
                   check=True)
    lib = winograd.typed(ctypes.CDLL(str(so)))
    inputs, ref = reference(3, 48, 32, 10, 12, bias=True)
    original = winograd.kernels
    winograd.kernels = lambda: lib
    try:
        got = through(kernel, *inputs)
    finally:
        winograd.kernels = original
    for a, r in zip(got, ref):
        assert relative(a, r) < 1e-6


def test_recomputed_levels_give_the_same_bits():
    """checkpoint_levels runs each level's forward again in backward: the kernel is
    deterministic, so the gradients are those of the stored-activation network."""
    stored, recomputed = net(), net(checkpoint_levels=True)
    recomputed.load_state_dict(stored.state_dict())
    for m in (stored, recomputed):
        assert fuse_winograd(m) == 9
    x = channels_last(torch.rand(2, 1, 32, 32)).requires_grad_()
    for m in (stored, recomputed):
        m.train()
        m(x).square().mean().backward()
    for a, b in zip(stored.parameters(), recomputed.parameters()):
        assert torch.equal(a.grad, b.grad)
