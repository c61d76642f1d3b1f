"""diffnet.generators: shape contract, registry, argument checks, checkpointing, dtypes."""
from __future__ import annotations

import json

import pytest
import torch

from diffnet.generators import (ACTIVATIONS, GENERATORS, UNet, UNetSmall, build_generator,
                                count_parameters, impose_dirichlet)


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
