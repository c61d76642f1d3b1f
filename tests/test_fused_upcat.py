"""The compiled bilinear upsampling + skip concatenation (diffnet.kernels.upcat): ATen's values
and gradients (bit for bit where ATen runs the same fused multiply-adds), independent of the
thread count, inf and NaN spread as in ATen, and the eager module wherever it does not apply."""
import pytest
import torch
import torch.nn.functional as F

from diffnet.generators import DenseGrad, UNet, UNet3D
from diffnet.kernels import FusedUp, UpsampleCat, fuse_upsample_cat
from tests.test_fused_kernels import channels_last, needs_gcc

pytestmark = needs_gcc


def eager(x, skip):
    """What diffnet.generators.Up computes before its ConvBlock."""
    up = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
    return torch.cat([DenseGrad.apply(up), skip], dim=1)


def fields(b, cu, cs, h, w, seed=0):
    torch.manual_seed(seed)
    x = channels_last(torch.randn(b, cu, h, w)).requires_grad_()
    skip = channels_last(torch.randn(b, cs, 2 * h, 2 * w)).requires_grad_()
    g = channels_last(torch.randn(b, cu + cs, 2 * h, 2 * w))
    return x, skip, g


def value_and_grads(fn, x, skip, g):
    y = fn(x, skip)
    return (y, *torch.autograd.grad(y, (x, skip), g))


def same_vector_path() -> bool:
    """ATen's AVX-512 kernels: the ones whose multiply-adds the kernel was matched against."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


@pytest.mark.parametrize("shape", [(2, 16, 8, 8, 8), (3, 32, 16, 5, 7), (2, 7, 9, 2, 3),
                                   (1, 5, 3, 1, 1), (2, 128, 64, 4, 4)])
def test_values_and_gradients_are_atens(shape):
    """Gradients bit for bit always (the same fused multiply-adds in the same order); values
    bit for bit where ATen's vector loop computes them (channels a multiple of its 16 lanes),
    else within one rounding: ATen's scalar tail associates its sum differently."""
    x, skip, g = fields(*shape)
    got, want = value_and_grads(UpsampleCat.apply, x, skip, g), value_and_grads(eager, x, skip, g)
    for a, b in zip(got, want):
        assert a.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(a, b, rtol=3e-7, atol=3e-7)
    if same_vector_path():
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
        if shape[1] % 16 == 0:
            assert torch.equal(got[0], want[0])


def test_same_bits_on_1_and_2_threads():
    x, skip, g = fields(3, 16, 8, 9, 5)
    threads, runs = torch.get_num_threads(), []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            runs.append(value_and_grads(UpsampleCat.apply, x, skip, g))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_inf_and_nan_spread_as_in_aten():
    """A corner of weight 0 is still added (0 * inf = NaN), as ATen adds it."""
    x, skip, g = fields(1, 16, 4, 4, 4)
    with torch.no_grad():
        x[0, 3, 1, 2] = float("nan")
    g[0, 0, 0, 0], g[0, 18, 3, 3] = float("inf"), float("nan")
    got, want = value_and_grads(UpsampleCat.apply, x, skip, g), value_and_grads(eager, x, skip, g)
    for a, b in zip(got, want):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf())
        assert a.isnan().any()


def net(**kw):
    torch.manual_seed(0)
    return UNet(in_channels=1, depth=2, base_width=4, **kw).to(memory_format=torch.channels_last)


def test_fuse_takes_every_bilinear_up_and_keeps_the_state_dict():
    plain, fused = net(), net()
    assert fuse_upsample_cat(fused) == 2 == sum(isinstance(m, FusedUp) for m in fused.modules())
    assert list(fused.state_dict()) == list(plain.state_dict())
    assert fuse_upsample_cat(fused) == 0  # already fused
    assert fuse_upsample_cat(net(upsample="transpose")) == 0
    assert fuse_upsample_cat(UNet3D(in_channels=1, depth=1)) == 0  # trilinear: eager


@pytest.mark.parametrize("case", ["channels_last", "nchw", "float64"])
def test_the_fused_network_is_the_eager_one(case):
    """channels_last: the kernel, equal to rounding (8 channels: ATen's scalar tail); NCHW and
    float64 run the eager modules, so the same bits."""
    plain, fused = net(), net()
    fuse_upsample_cat(fused)
    x = channels_last(torch.rand(2, 1, 16, 16))
    if case == "nchw":
        plain, fused, x = (m.to(memory_format=torch.contiguous_format) for m in (plain, fused, x))
    if case == "float64":
        plain, fused, x = plain.double(), fused.double(), x.double()
    outs = []
    for m in (plain, fused):
        x_ = x.clone().requires_grad_()
        y = m(x_)
        y.square().sum().backward()
        outs.append((y, x_.grad, m.ups[0].block[0].weight.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert torch.equal(a, b) or case == "channels_last"


def test_at_the_default_widths_the_kernel_changes_no_trajectory():
    """On AVX-512, a network of the default widths trains the same bits with the kernel as
    without it: what lets train.fused_kernels keep the recipes' re-measured errors."""
    if not same_vector_path():
        pytest.skip("bit for bit only against ATen's AVX-512 kernels")
    torch.manual_seed(0)
    plain = UNet(in_channels=1, depth=2).to(memory_format=torch.channels_last)
    fused = UNet(in_channels=1, depth=2).to(memory_format=torch.channels_last)
    fused.load_state_dict(plain.state_dict())
    assert fuse_upsample_cat(fused) == 2
    x = channels_last(torch.rand(4, 1, 32, 32))
    for m in (plain, fused):
        m(x).square().mean().backward()
    assert torch.equal(plain(x), fused(x))
    for a, b in zip(plain.parameters(), fused.parameters()):
        assert torch.equal(a.grad, b.grad)
