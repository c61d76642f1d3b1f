"""3-D generators: the U-Net on (B, C, D, H, W) (registry "unet3d": shapes, options, errors,
checkpointing, channels_last_3d), the 2-D U-Net's weights unchanged by the dimension-generic
blocks, instance norm of 5-D input against nn.InstanceNorm3d, trilinear node resampling."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from diffnet.generators import (GENERATORS, UNet, UNet3D, build_generator, count_parameters,
                                generator_name)
from diffnet.norms import InstanceNorm
from diffnet.resample import resample_nodes

F64 = torch.float64


def small(**kwargs):
    """A tiny 3-D U-Net so the tests stay fast on 2 cores."""
    args = dict(in_channels=2, depth=2, base_width=4, max_width=8)
    args.update(kwargs)
    return UNet3D(**args)


# -- the 3-D U-Net --------------------------------------------------------------------------------
@pytest.mark.parametrize("dhw", [(16, 16, 16), (8, 16, 4), (12, 8, 16)])
def test_shape_contract(dhw):
    torch.manual_seed(0)
    out = small(out_channels=2)(torch.randn(2, 2, *dhw))
    assert out.shape == (2, 2, *dhw) and torch.isfinite(out).all()


def test_registry_config_round_trip_and_name():
    assert GENERATORS["unet3d"] is UNet3D
    torch.manual_seed(1)
    model = build_generator("unet3d", in_channels=2, depth=2, base_width=4, max_width=8,
                            activation="silu", upsample="transpose", downsample="avgpool")
    assert generator_name(model) == "unet3d"
    cfg = json.loads(json.dumps(model.config()))  # what a checkpoint stores
    assert cfg["upsample"] == "transpose" and set(cfg) == set(UNet(in_channels=1).config())
    clone = build_generator("unet3d", **cfg)
    clone.load_state_dict(model.state_dict())
    x = torch.randn(1, 2, 8, 8, 12)
    torch.testing.assert_close(clone(x), model(x))


def test_default_size_is_the_documented_one():
    """The counts stated in the UNet3D docstring: 3x3x3 kernels, same widths as 2-D."""
    assert count_parameters(UNet3D(in_channels=1)) == 4_260_913
    assert count_parameters(UNet3D(in_channels=1, depth=3, base_width=8, max_width=64)) == 401_881
    assert UNet3D(in_channels=1).widths == UNet(in_channels=1).widths
    assert UNet3D(in_channels=1).config()["upsample"] == "trilinear"


def test_2d_unet_keeps_its_parameter_names_and_shapes():
    """Old checkpoints load: the 2-D U-Net's state_dict keys and shapes are those of the
    U-Net before the blocks became dimension-generic (listed here for a depth-1 model)."""
    got = {k: tuple(v.shape) for k, v in
           UNet(in_channels=2, depth=1, base_width=4, max_width=8).state_dict().items()}

    def block(p, ci, co):
        return {f"{p}.0.weight": (co, ci, 3, 3), f"{p}.1.weight": (co,), f"{p}.1.bias": (co,),
                f"{p}.3.weight": (co, co, 3, 3), f"{p}.4.weight": (co,), f"{p}.4.bias": (co,)}

    want = {**block("inc", 2, 4), **block("downs.0.block", 4, 8), **block("ups.0.block", 12, 4),
            "downs.0.pool.weight": (4, 4, 3, 3), "downs.0.pool.bias": (4,),
            "outc.weight": (1, 4, 1, 1), "outc.bias": (1,)}
    assert got == want
    assert "dims" not in UNet(in_channels=1).config()      # a 2-D config is what it was


@pytest.mark.parametrize("cls, bad, valid", [
    (UNet3D, "bilinear", "('trilinear', 'transpose')"),
    (UNet, "trilinear", "('bilinear', 'transpose')"),
])
def test_upsample_mode_belongs_to_the_dimension(cls, bad, valid):
    with pytest.raises(ValueError, match="upsample") as e:
        cls(in_channels=1, upsample=bad)
    assert valid in str(e.value)


@pytest.mark.parametrize("kwargs, name", [
    (dict(in_channels=0), "in_channels"),
    (dict(in_channels=1, depth=11), "depth"),
    (dict(in_channels=1, base_width=32, max_width=16), "max_width"),
    (dict(in_channels=1, norm="batch"), "norm"),
    (dict(in_channels=1, activation="sigmoid"), "activation"),
    (dict(in_channels=1, downsample="maxpool"), "downsample"),
    (dict(in_channels=1, checkpoint_levels=1), "checkpoint_levels"),
])
def test_bad_arguments_name_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        UNet3D(**kwargs)


def test_input_errors_name_the_axes_and_the_nearest_sizes():
    model = small(depth=3)  # multiples of 8
    with pytest.raises(ValueError) as e:
        model(torch.zeros(1, 2, 16, 20, 8))
    msg = str(e.value)
    assert "16x20x8" in msg and "D in [16], H in [16, 24], W in [8]" in msg and "depth" in msg
    with pytest.raises(ValueError, match=r"\(B, 2, D, H, W\)"):
        model(torch.zeros(1, 2, 16, 16))
    with pytest.raises(ValueError, match=r"\(B, 2, H, W\)"):   # the 2-D net refuses 3-D input
        UNet(in_channels=2, depth=1)(torch.zeros(1, 2, 4, 4, 4))
    with pytest.raises(ValueError, match="1x1x1 coarsest level"):
        model(torch.zeros(1, 2, 8, 8, 8))
    small(depth=3, norm="none")(torch.zeros(1, 2, 8, 8, 8))  # fine without a norm


def _out_and_grads(model, x):
    model.zero_grad()
    out = model(x)
    out.square().mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def test_checkpoint_levels_same_output_and_gradients():
    torch.manual_seed(0)
    plain = small(depth=2)
    ckpt = small(depth=2, checkpoint_levels=True)
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(2, 2, 8, 8, 16)
    out_a, grads_a = _out_and_grads(plain, x)
    out_b, grads_b = _out_and_grads(ckpt, x)
    torch.testing.assert_close(out_b, out_a)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(gb, ga)


@pytest.mark.parametrize("upsample", ["trilinear", "transpose"])
def test_channels_last_3d_matches_contiguous(upsample):
    """The same outputs and gradients in NDHWC (float32 tolerance: oneDNN reorders sums)."""
    torch.manual_seed(0)
    model = small(upsample=upsample)
    x = torch.randn(2, 2, 16, 8, 16)
    ref, gref = _out_and_grads(model, x)
    model = model.to(memory_format=torch.channels_last_3d)
    out, grads = _out_and_grads(model, x.contiguous(memory_format=torch.channels_last_3d))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for g, r in zip(grads, gref):
        torch.testing.assert_close(g, r, rtol=1e-3, atol=1e-5)


def test_float64_and_backward():
    model = small().double()
    out = model(torch.randn(1, 2, 8, 8, 8, dtype=F64))
    assert out.dtype == F64
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


# -- instance norm of 5-D input -------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["ncdhw", "channels_last_3d"])
def test_instance_norm_5d_matches_instance_norm_3d(layout):
    """Group-norm path (the NHWC kernel is 4-D only): nn.InstanceNorm3d(affine=True)'s output
    and gradients in float64 to 1e-9 relative (norm-wise), a channel with |mean|/std = 1e5
    included, on which ATen's NDHWC group norm itself is off by ~1e-6 (one-pass variance):
    channels_last_3d input is normalised as an NCDHW copy and stays channels_last_3d."""
    g = torch.Generator().manual_seed(3)
    shape = (2, 3, 4, 5, 6)
    x = torch.randn(shape, dtype=F64, generator=g) * torch.tensor([0.5, 1.0, 1e-2], dtype=F64
                                                                   ).view(1, 3, 1, 1, 1)
    x = x + torch.tensor([2.0, -1.0, 1e3], dtype=F64).view(1, 3, 1, 1, 1)
    if layout == "channels_last_3d":
        x = x.contiguous(memory_format=torch.channels_last_3d)
    ours, ref = InstanceNorm(3).double(), torch.nn.InstanceNorm3d(3, affine=True).double()
    with torch.no_grad():
        for m in (ours, ref):
            m.weight.copy_(torch.tensor([1.5, -0.5, 2.0]))
            m.bias.copy_(torch.tensor([0.1, 0.2, -0.3]))
    xa, xb = x.clone().requires_grad_(), x.contiguous().requires_grad_()
    ya, yb = ours(xa), ref(xb)
    assert not type(ya.grad_fn).__name__.startswith("InstanceNormNHWC")
    assert ya.is_contiguous(memory_format=torch.channels_last_3d) == (layout != "ncdhw")
    go = torch.randn(shape, dtype=F64, generator=g)
    (ya * go).sum().backward()
    (yb * go).sum().backward()
    for a, b in ((ya.detach(), yb.detach()), (xa.grad, xb.grad),
                 (ours.weight.grad, ref.weight.grad), (ours.bias.grad, ref.bias.grad)):
        assert (a - b).abs().max() <= 1e-9 * b.abs().max()


# -- trilinear node resampling --------------------------------------------------------------------
def _trilinear(d, h, w):
    z, y, x = (torch.linspace(0, 1, n, dtype=F64) for n in (d, h, w))
    z, y, x = z[:, None, None], y[None, :, None], x[None, None, :]
    return (1 + 2 * x - 3 * y + z + 5 * x * y - 2 * y * z + 4 * x * y * z)[None, None]


def test_resample_3d_exact_on_trilinear_fields_both_ways():
    for src, dst in (((5, 9, 17), (17, 33, 9)), ((17, 33, 9), (5, 9, 17))):
        out = resample_nodes(_trilinear(*src), dst)
        np.testing.assert_allclose(out.numpy(), _trilinear(*dst).numpy(), rtol=0, atol=1e-13)


def test_resample_3d_identity_corners_and_bad_sizes():
    a = torch.randn(2, 3, 8, 8, 8, dtype=F64)
    assert resample_nodes(a, (8, 8, 8)) is a
    b = resample_nodes(a, (13, 11, 7))
    for i in (0, -1):
        for j in (0, -1):
            for k in (0, -1):
                torch.testing.assert_close(b[..., i, j, k], a[..., i, j, k], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="one node count per grid axis"):
        resample_nodes(a, (16, 16))


def test_resample_3d_second_order():
    def field(n):
        t = torch.linspace(0, 1, n, dtype=F64)
        return (torch.sin(3 * t)[:, None, None] * torch.cos(2 * t)[None, :, None]
                * torch.exp(t)[None, None, :])

    errs = [float((resample_nodes(field(n)[None, None], (65, 65, 65))[0, 0] - field(65)
                   ).abs().max()) for n in (9, 17, 33)]
    orders = np.log2(np.array(errs[:-1]) / np.array(errs[1:]))
    assert orders.min() > 1.8, (errs, orders)
