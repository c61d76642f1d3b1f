"""diffnet.generators: shape contract, registry, argument checks, checkpointing, dtypes, and the
hand-written NHWC instance norm (forward and backward) against autograd and ATen."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from diffnet.generators import (ACTIVATIONS, GENERATORS, DenseGrad, InstanceNorm, UNet, UNetSmall,
                                build_generator, count_parameters, impose_dirichlet)
from diffnet.norms import InstanceNormNHWC


def small(**kwargs):
    """A tiny U-Net so the tests stay fast on 2 cores."""
    args = dict(in_channels=2, depth=2, base_width=4, max_width=16)
    args.update(kwargs)
    return UNet(**args)


@pytest.mark.parametrize("hw", [(16, 16), (32, 64), (64, 32), (8, 24)])
def test_shape_contract(hw):
    torch.manual_seed(0)
    model = small(out_channels=3)
    out = model(torch.randn(2, 2, *hw))
    assert out.shape == (2, 3, *hw)
    assert torch.isfinite(out).all()


def test_default_parameter_count_is_diffnet_sized():
    n = count_parameters(UNet(in_channels=1))
    assert 1_000_000 <= n <= 4_000_000
    assert n == 1_422_097  # the number stated in the UNet docstring


def test_widths_double_and_cap():
    assert UNet(in_channels=1, depth=5, base_width=16, max_width=128).widths == [
        16, 32, 64, 128, 128, 128]


def test_registry_and_errors_list_names():
    assert set(GENERATORS) >= {"unet", "unet-small"}
    model = build_generator("unet-small", in_channels=1)
    assert isinstance(model, UNetSmall)
    with pytest.raises(ValueError, match="unet") as info:
        build_generator("resnet", in_channels=1)
    assert "unet-small" in str(info.value) and "resnet" in str(info.value)


@pytest.mark.parametrize("name", ["unet", "unet-small"])
def test_config_rebuilds_identical_model(name):
    torch.manual_seed(1)
    model = build_generator(name, in_channels=1, depth=2, base_width=4, activation="silu")
    cfg = json.loads(json.dumps(model.config()))  # JSON round trip: what a checkpoint stores
    clone = build_generator(name, **cfg)
    clone.load_state_dict(model.state_dict())
    x = torch.randn(1, 1, 8, 12)
    torch.testing.assert_close(clone(x), model(x))


def test_deterministic_init():
    torch.manual_seed(123)
    a = small()
    torch.manual_seed(123)
    b = small()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("kwargs, name", [
    (dict(in_channels=0), "in_channels"),
    (dict(in_channels=1.5), "in_channels"),
    (dict(in_channels=True), "in_channels"),
    (dict(in_channels=1, out_channels=0), "out_channels"),
    (dict(in_channels=1, depth=-1), "depth"),
    (dict(in_channels=1, base_width=0), "base_width"),
    (dict(in_channels=1, base_width=32, max_width=16), "max_width"),
    (dict(in_channels=1, norm="batch"), "norm"),
    (dict(in_channels=1, activation="sigmoid"), "activation"),
    (dict(in_channels=1, downsample="maxpool"), "downsample"),
    (dict(in_channels=1, upsample="nearest"), "upsample"),
    (dict(in_channels=1, checkpoint_levels="yes"), "checkpoint_levels"),
])
def test_bad_arguments_raise_value_error_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        UNet(**kwargs)


def test_bad_choice_errors_list_allowed_values():
    with pytest.raises(ValueError, match="instance") as info:
        UNet(in_channels=1, norm="batch")
    assert "'none'" in str(info.value)
    with pytest.raises(ValueError) as info:
        UNet(in_channels=1, activation="sigmoid")
    assert all(a in str(info.value) for a in ACTIVATIONS)


def test_indivisible_grid_names_grid_depth_and_nearest_sizes():
    model = small(depth=3)  # multiples of 8
    with pytest.raises(ValueError, match="depth") as info:
        model(torch.zeros(1, 2, 20, 16))
    msg = str(info.value)
    assert "20x16" in msg and "16, 24" in msg
    with pytest.raises(ValueError, match=r"\(B, 2, H, W\)"):
        model(torch.zeros(1, 3, 16, 16))


def test_instance_norm_rejects_1x1_coarsest_level_in_training():
    model = small(depth=3)
    with pytest.raises(ValueError, match="instance norm"):
        model(torch.zeros(1, 2, 8, 8))
    small(depth=3, norm="none")(torch.zeros(1, 2, 8, 8))  # fine without a norm


def _loss_and_grads(model, x):
    model.zero_grad()
    out = model(x)
    (out**2).mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("upsample", ["bilinear", "transpose"])
def test_checkpoint_levels_same_output_and_gradients(upsample):
    torch.manual_seed(0)
    plain = small(depth=3, upsample=upsample, downsample="avgpool")
    ckpt = small(depth=3, upsample=upsample, downsample="avgpool", checkpoint_levels=True)
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(2, 2, 16, 32)
    out_a, grads_a = _loss_and_grads(plain, x)
    out_b, grads_b = _loss_and_grads(ckpt, x)
    torch.testing.assert_close(out_b, out_a)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(gb, ga)


def test_float64():
    model = small().double()
    out = model(torch.randn(1, 2, 16, 16, dtype=torch.float64))
    assert out.dtype == torch.float64
    out.sum().backward()


def test_channels_last_matches_contiguous():
    torch.manual_seed(0)
    model = small(upsample="transpose")
    x = torch.randn(2, 2, 16, 32)
    ref = model(x)
    model = model.to(memory_format=torch.channels_last)
    out = model(x.to(memory_format=torch.channels_last))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_every_activation_runs(activation):
    out = small(activation=activation, norm="none")(torch.randn(1, 2, 8, 8))
    assert out.shape == (1, 1, 8, 8)


def test_impose_dirichlet():
    u = torch.randn(2, 1, 6, 7, requires_grad=True)
    mask = torch.zeros(1, 1, 6, 7)
    mask[..., 0, :] = mask[..., -1, :] = mask[..., :, 0] = mask[..., :, -1] = 1
    values = torch.full((2, 1, 6, 7), 3.0)
    v = impose_dirichlet(u, mask, values)
    assert torch.equal(v[mask.expand_as(v) == 1], torch.full((2 * 22,), 3.0))
    assert torch.equal(v[..., 1:-1, 1:-1], u[..., 1:-1, 1:-1])
    v.sum().backward()
    assert torch.equal(u.grad, (1 - mask).expand_as(u))
    torch.testing.assert_close(impose_dirichlet(u, mask.bool(), values), v)


# ----------------------------------------------------------------------------- NHWC instance norm
F64 = torch.float64
EPS = 1e-5


def _nhwc_input(shape, means=0.0, stds=1.0, seed=0):
    """A float64 channels_last (B, C, H, W) tensor whose channel c has mean ~means[c], std ~stds[c]."""
    g = torch.Generator().manual_seed(seed)
    c = shape[1]
    mean = torch.as_tensor(means, dtype=F64).expand(c).reshape(1, c, 1, 1)
    std = torch.as_tensor(stds, dtype=F64).expand(c).reshape(1, c, 1, 1)
    x = torch.randn(shape, dtype=F64, generator=g) * std + mean
    return x.contiguous(memory_format=torch.channels_last)


def _affine(c, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(c, dtype=F64, generator=g), torch.randn(c, dtype=F64, generator=g)


def _value_and_grads(fn, x, weight, bias, g):
    """fn(x, weight, bias) and the gradients of <fn(...), g> with respect to x, weight, bias."""
    x, weight, bias = (t.detach().clone().requires_grad_() for t in (x, weight, bias))
    y = fn(x, weight, bias)
    (y * g).sum().backward()
    return y.detach(), x.grad, weight.grad, bias.grad


def _nhwc(x, weight, bias):
    return InstanceNormNHWC.apply(x, weight, bias, EPS)


def _aten(x, weight, bias):
    return F.instance_norm(x.contiguous(), weight=weight, bias=bias, eps=EPS)


def _assert_rel_close(actual, expected, tol, what):
    """max |actual - expected| <= tol * max |expected| (a norm-wise bound: entries near zero do
    not make an elementwise relative error meaningless)."""
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= tol * scale, f"{what}: max error {err:.3e} > {tol:g} * {scale:.3e}"


# (shape, per-channel means, per-channel stds): batch > 1, channels > 1, H != W everywhere
NORM_CASES = {
    "centred": ((2, 3, 5, 7), [0.0, 0.3, -0.2], [1.0, 0.5, 2.0]),
    "tall": ((3, 2, 8, 3), [1.0, -2.0], [0.1, 3.0]),
    # |mean| / std = 1e4: the one-pass variance without the shift loses ~8 digits here
    "mean>>std": ((2, 3, 5, 7), [1e4, -3e3, 0.5], [1.0, 0.2, 2.0]),
}


@pytest.mark.parametrize("case", sorted(NORM_CASES))
def test_instance_norm_nhwc_gradcheck(case):
    """torch.autograd.gradcheck (float64 finite differences) of the custom NHWC function's
    backward with respect to x, weight and bias, on channels_last input."""
    shape, means, stds = NORM_CASES[case]
    x = _nhwc_input(shape, means, stds).requires_grad_()
    weight, bias = (t.requires_grad_() for t in _affine(shape[1]))
    assert torch.autograd.gradcheck(_nhwc, (x, weight, bias), eps=1e-6, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("grad_layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("case,tol", [("centred", 1e-12), ("tall", 1e-12), ("mean>>std", 1e-9)])
def test_instance_norm_nhwc_matches_aten_instance_norm(case, tol, grad_layout):
    """Output and x/weight/bias gradients of the NHWC function equal F.instance_norm's (weight
    and bias given) in float64 for either memory layout of the incoming gradient; the output
    stays channels_last. At |mean|/std = 1e4 a variance E[x^2] - E[x]^2 without the shift
    would be off by ~1e-7 (relative), 100x the tolerance."""
    shape, means, stds = NORM_CASES[case]
    x = _nhwc_input(shape, means, stds)
    weight, bias = _affine(shape[1])
    g = torch.randn(shape, dtype=F64, generator=torch.Generator().manual_seed(2))
    if grad_layout == "channels_last":
        g = g.contiguous(memory_format=torch.channels_last)
    got = _value_and_grads(_nhwc, x, weight, bias, g)
    ref = _value_and_grads(_aten, x, weight, bias, g)
    assert got[0].is_contiguous(memory_format=torch.channels_last)
    assert got[1].shape == x.shape and got[2].shape == got[3].shape == (shape[1],)
    for name, a, e in zip(("output", "grad x", "grad weight", "grad bias"), got, ref):
        _assert_rel_close(a, e, tol, name)


def test_instance_norm_nhwc_extreme_mean_to_std_ratio():
    """|mean|/std = 1e8 (mean +-1e6, std 1e-2), where a one-pass variance without the shift
    is wrong by O(1): output and gradients still match a two-pass float64 reference and ATen."""
    shape = (2, 3, 6, 4)
    x = _nhwc_input(shape, [1e6, -1e6, 3.0], [1e-2, 1e-2, 1.0], seed=5)
    weight, bias = _affine(3, seed=6)
    g = torch.randn(shape, dtype=F64, generator=torch.Generator().manual_seed(7))

    def two_pass(x, weight, bias):
        xc = x - x.mean((2, 3), keepdim=True)
        var = (xc * xc).mean((2, 3), keepdim=True)
        return xc * torch.rsqrt(var + EPS) * weight.view(1, -1, 1, 1) + bias.view(1, -1, 1, 1)

    got = _value_and_grads(_nhwc, x, weight, bias, g)
    for reference in (two_pass, _aten):
        ref = _value_and_grads(reference, x.contiguous(), weight, bias, g)
        for name, a, e in zip(("output", "grad x", "grad weight", "grad bias"), got, ref):
            _assert_rel_close(a, e, 1e-6, f"{reference.__name__} {name}")


@pytest.mark.parametrize("layout", ["channels_last", "nchw"])
def test_instance_norm_module_picks_path_by_layout_and_matches_instance_norm_2d(layout):
    """InstanceNorm runs the NHWC function exactly for channels_last 4-D input (group norm
    otherwise) and both paths give nn.InstanceNorm2d(affine=True)'s output and gradients."""
    shape = (2, 3, 6, 10)
    x = _nhwc_input(shape, [2.0, -1.0, 0.0], [0.5, 1.0, 3.0], seed=3)
    if layout == "nchw":
        x = x.contiguous()
    weight, bias = _affine(3, seed=4)
    ours, ref = InstanceNorm(3).double(), torch.nn.InstanceNorm2d(3, affine=True).double()
    with torch.no_grad():
        for m in (ours, ref):
            m.weight.copy_(weight)
            m.bias.copy_(bias)
    xa, xb = x.clone().requires_grad_(), x.contiguous().requires_grad_()
    ya, yb = ours(xa), ref(xb)
    nhwc = type(ya.grad_fn).__name__.startswith("InstanceNormNHWC")
    assert nhwc == (layout == "channels_last"), type(ya.grad_fn).__name__
    g = torch.randn(shape, dtype=F64, generator=torch.Generator().manual_seed(8))
    (ya * g).sum().backward()
    (yb * g).sum().backward()
    _assert_rel_close(ya.detach(), yb.detach(), 1e-12, "output")
    _assert_rel_close(xa.grad, xb.grad, 1e-12, "grad x")
    _assert_rel_close(ours.weight.grad, ref.weight.grad, 1e-12, "grad weight")
    _assert_rel_close(ours.bias.grad, ref.bias.grad, 1e-12, "grad bias")


def test_instance_norm_nhwc_is_accurate_in_float32_on_a_large_grid():
    """1024x1024 in float32: the sums over a million nodes are taken in chunks of rows (one GEMM
    over all of them was 2.7e-3 off in the normalised output); output within 1e-5 of float64."""
    gen = torch.Generator().manual_seed(11)
    x = (3.0 + 0.1 * torch.randn((1, 2, 1024, 1024), generator=gen)).contiguous(
        memory_format=torch.channels_last)
    w, b = torch.ones(2), torch.zeros(2)
    got = InstanceNorm(2)(x)
    x64 = x.double()
    ref = (x64 - x64.mean((2, 3), keepdim=True)) * torch.rsqrt(
        x64.var((2, 3), unbiased=False, keepdim=True) + EPS)
    assert (got.double() - ref).abs().max() < 1e-5
    assert torch.equal(w, InstanceNorm(2).weight.data) and torch.equal(b, InstanceNorm(2).bias.data)


@pytest.mark.parametrize("fmt, shape", [(torch.channels_last, (2, 3, 4, 5)),
                                        (torch.channels_last_3d, (2, 3, 4, 5, 6)),
                                        (torch.contiguous_format, (2, 3, 4, 5))])
def test_dense_grad_hands_on_the_concatenation_gradient_dense_and_unchanged(fmt, shape):
    a = torch.randn(shape, dtype=torch.float64).contiguous(memory_format=fmt).requires_grad_()
    seen = {}
    a.register_hook(lambda g: seen.setdefault("g", g))
    skip = torch.randn(shape, dtype=torch.float64).contiguous(memory_format=fmt)
    z = torch.cat([DenseGrad.apply(a), skip], dim=1)
    gz = torch.randn_like(z)
    z.backward(gz)
    assert seen["g"].is_contiguous(memory_format=fmt)
    assert torch.equal(seen["g"], gz[:, :shape[1]])
    # Without it the gradient is the slice, dense in no format (what DenseGrad is for).
    b = a.detach().clone().requires_grad_()
    b.register_hook(lambda g: seen.__setitem__("plain", g))
    torch.cat([b, skip], dim=1).backward(gz)
    assert not seen["plain"].is_contiguous(memory_format=fmt)


def test_unet_gradients_are_those_of_the_plain_concatenation():
    torch.manual_seed(0)
    net = UNet(in_channels=2, depth=2, base_width=4, max_width=8).double()
    net = net.to(memory_format=torch.channels_last)
    x = torch.randn(2, 2, 16, 16, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    net(x).square().sum().backward()
    dense = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    for up in net.ups:  # the same network, concatenating without DenseGrad
        up.forward = lambda y, skip, up=up: up.block(torch.cat([up.up(y), skip], dim=1))
    net(x).square().sum().backward()
    assert all(torch.equal(d, p.grad) for d, p in zip(dense, net.parameters()))
