"""diffnet.split_layers without MPI: on the undivided Block a split U-Net is the original one
(float64); single layers on interior blocks equal their block of the global output (halos cut
from the known global input); parameters and state_dict keys survive; refusals.
The split over real ranks is tests/test_split_unet_mpi.py."""
import copy
import itertools

import pytest
import torch
from torch import nn

from diffnet.domain import Block
from diffnet.generators import Prolonged, build_generator
from diffnet.split_layers import check_generator_split, plan, rebuild, split_generator


def assert_close(a, b, rtol=1e-12):
    """Elementwise rtol, with an absolute floor of rtol * max|b|: a gradient entry that cancels
    to ~0 differs by the rounding of its terms, not of itself."""
    torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * float(b.detach().abs().max()))


def grads(model):
    return [p.grad.clone() if p.grad is not None else None for p in model.parameters()]


def forward_backward(model, x, w):
    model.zero_grad()
    out = model(x)
    (out * w).sum().backward()
    return out.detach(), grads(model)


def assert_split_equals_original(name, grid, x_format=None, **kw):
    torch.manual_seed(0)
    model = build_generator(name, in_channels=2, depth=2, base_width=4, **kw).double()
    split = split_generator(copy.deepcopy(model), Block(grid))
    x = torch.randn(2, 2, *grid, dtype=torch.float64)
    if x_format is not None:
        x = x.contiguous(memory_format=x_format)
    w = torch.randn(2, 1, *grid, dtype=torch.float64)
    out, g = forward_backward(model, x, w)
    out_s, g_s = forward_backward(split, x, w)
    assert_close(out_s, out)
    for a, b in zip(g_s, g):
        assert_close(a, b)
    return model, split


@pytest.mark.parametrize("norm,down,up", list(itertools.product(
    ["instance", "none"], ["conv", "avgpool"], ["bilinear", "transpose"])))
def test_unet_on_the_whole_block_is_the_unet(norm, down, up):
    assert_split_equals_original("unet", (16, 8), norm=norm, downsample=down, upsample=up)


@pytest.mark.parametrize("norm,up", [("instance", "trilinear"), ("none", "transpose")])
def test_unet3d_on_the_whole_block_is_the_unet3d(norm, up):
    assert_split_equals_original("unet3d", (8, 4, 8), norm=norm, upsample=up)


def test_channels_last_and_checkpointed_levels():
    assert_split_equals_original("unet", (8, 8), torch.channels_last, checkpoint_levels=True)
    assert_split_equals_original("unet3d", (4, 8, 4), torch.channels_last_3d)


def test_parameters_and_state_dict_keys_survive_the_split():
    model = build_generator("unet", in_channels=1, depth=2, base_width=4)
    params = [id(p) for p in model.parameters()]
    keys = list(model.state_dict())
    split = split_generator(model, Block((8, 8)))
    assert split is model
    assert [id(p) for p in model.parameters()] == params
    assert list(model.state_dict()) == keys
    kinds = {type(m).__name__ for m in model.modules()}
    assert {"SplitConv2d", "SplitUpsample", "SplitInstanceNorm"} <= kinds, kinds
    assert "Conv2d" in kinds  # the 1x1 output convolution stays as it is
    # Splitting again (another grid) points the same split layers at the new block.
    layers = list(model.modules())
    split_generator(model, Block((16, 8)))
    assert list(model.modules()) == layers
    assert [id(p) for p in model.parameters()] == params
    assert model.inc[0].block.grid == (16, 8) and model.domain_block.grid == (16, 8)


def prolonged(grid=(16, 16), inner_grid=(8, 8), depth=1):
    torch.manual_seed(0)
    inner = build_generator("unet", in_channels=2, depth=depth, base_width=4)
    model = Prolonged(inner=inner, inner_grid=inner_grid, grid=grid, in_channels=2,
                      correction={"depth": 1, "base_width": 4}).double()
    with torch.no_grad():  # a correction that answers (its last layer starts at zero)
        model.correction.outc.weight.normal_()
    return model


def test_a_prolonged_network_on_the_whole_block_is_itself_on_its_grids():
    nested = Prolonged(inner=prolonged(), inner_grid=(16, 16), grid=(32, 32), in_channels=2,
                       correction={"depth": 2, "base_width": 4}).double()
    for grid in [(32, 32), (16, 16), (8, 8)]:  # its own grid, then its inner networks'
        model = copy.deepcopy(nested)
        split = split_generator(copy.deepcopy(model), Block(grid))
        x, w = torch.randn(2, 2, *grid, dtype=torch.float64), torch.randn(2, 1, *grid,
                                                                           dtype=torch.float64)
        out, g = forward_backward(model, x, w)
        out_s, g_s = forward_backward(split, x, w)
        assert_close(out_s, out)
        assert [a is None for a in g_s] == [b is None for b in g]  # (networks not run)
        for a, b in zip(g_s, g):
            if b is not None:
                assert_close(a, b)
    kinds = {type(m).__name__ for m in split.inner.inner.modules()}
    assert "SplitConv2d" in kinds and split.inner.inner.domain_block.grid == (8, 8)


def test_a_block_in_another_grid_keeps_its_place_in_the_split():
    block = Block((32, 64), start=(16, 32), shape=(16, 16))  # block (1, 2) of a [2, 4] split
    coarse = block.in_grid((8, 12))
    assert (coarse.grid, coarse.start, coarse.shape) == ((8, 12), (4, 6), (4, 3))
    assert block.in_grid((32, 64)) is block
    with pytest.raises(ValueError, match="cannot be split"):
        block.in_grid((9, 12))


def test_a_prolonged_split_names_the_network_a_block_does_not_suit():
    model = prolonged(grid=(32, 32), inner_grid=(16, 16), depth=2)
    check_generator_split(model, (32, 32), (2, 2))  # blocks 16 and 8: multiples of 2 and 4
    with pytest.raises(ValueError, match="grid 16x16 .* multiples of 4"):  # inner: 2x2 blocks
        check_generator_split(model, (32, 32), (8, 8))
    with pytest.raises(ValueError, match="the correction network on \\[32, 32\\]"):
        check_generator_split(model, (32, 32), (32, 1))
    # a chain 8 -> 16 -> 32 whose first network cannot take the split on its grid: the
    # message follows the chain down to it (infer --domain on 32x32 would otherwise name
    # only an 8x8 grid nobody asked for)
    nested = Prolonged(inner=prolonged(depth=2), inner_grid=(16, 16), grid=(32, 32),
                       in_channels=2, correction={"depth": 1, "base_width": 4})
    with pytest.raises(ValueError, match=r"^the network it grew from on \[16, 16\]: the network "
                                         r"it grew from on \[8, 8\]: grid 8x8 .* multiples of 4"):
        check_generator_split(nested, (32, 32), (4, 4))


@pytest.mark.parametrize("layer,match", [
    (nn.Dropout(0.1), "does not know"),
    (nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular"), "circular"),
    (nn.Conv2d(4, 4, 3), "grid / stride"),
    (nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True), "align_corners=True"),
])
def test_unknown_or_non_local_layers_are_refused_by_name(layer, match):
    model = build_generator("unet", in_channels=1, depth=1, base_width=4, norm="none")
    model.inc[1] = layer
    before = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=rf"inc\.1 .*{match}"):
        split_generator(model, Block((8, 8)))
    assert [type(m) for m in model.modules()] == before  # nothing replaced


def test_bad_splits_are_refused_before_training():
    model = build_generator("unet", in_channels=1, depth=3, base_width=4)
    check_generator_split(model, (32, 64), (2, 4))
    with pytest.raises(ValueError, match=r"multiples of 8.*nearest valid"):
        check_generator_split(model, (32, 64), (4, 3))
    with pytest.raises(ValueError, match="multiples of 2\\*\\*depth = 8"):
        split_generator(model, Block((32, 32), start=(0, 4), shape=(32, 4)))
    with pytest.raises(ValueError, match="3-D block"):
        split_generator(model, Block((8, 8, 8)))
    split = split_generator(model, Block((32, 32), start=(16, 0), shape=(16, 32)))
    with pytest.raises(ValueError, match="not this block"):
        split(torch.randn(1, 1, 32, 32))


class SliceBlock(Block):
    """A block of a layer whose global input ``field`` is known: halos are cut from it."""

    def __init__(self, field, start, shape):
        super().__init__(field.shape[2:], start, shape)
        self.field = field

    def halo(self, x, width=1, fill="zeros"):
        padded = Block(self.grid).halo(self.field, width, fill)
        window = Block(padded.shape[2:], self.start, [n + 2 * width for n in self.shape])
        return window.local(padded)


def blocks(grid, split):
    shape = [g // s for g, s in zip(grid, split)]
    for idx in itertools.product(*(range(s) for s in split)):
        yield [i * n for i, n in zip(idx, shape)], shape


@pytest.mark.parametrize("grid,split", [((8, 12), (2, 3)), ((4, 8, 4), (2, 2, 1))])
def test_layers_on_interior_blocks_give_their_block_of_the_global_output(grid, split):
    dims = len(grid)
    conv, pool = (nn.Conv2d, nn.AvgPool2d) if dims == 2 else (nn.Conv3d, nn.AvgPool3d)
    mode = "bilinear" if dims == 2 else "trilinear"
    torch.manual_seed(1)
    layers = [conv(3, 2, 3, padding=1), conv(3, 3, 3, stride=2, padding=1), pool(2),
              nn.Upsample(scale_factor=2, mode=mode, align_corners=False),
              nn.Upsample(scale_factor=3, mode=mode, align_corners=False)]
    x = torch.randn(2, 3, *grid, dtype=torch.float64)
    for layer in layers:
        layer.double()
        holder = build_generator("unet" if dims == 2 else "unet3d", in_channels=1, depth=0)
        holder.inc = nn.Sequential(layer)
        (_, _, cls), = plan(holder)
        full = layer(x)
        for start, shape in blocks(grid, split):
            split_layer = rebuild(layer, cls, SliceBlock(x, start, shape))
            out = split_layer(Block(grid, start, shape).local(x))
            f = [full.shape[2 + a] / grid[a] for a in range(dims)]
            want = Block(full.shape[2:], [int(s * k) for s, k in zip(start, f)],
                         [int(n * k) for n, k in zip(shape, f)]).local(full)
            assert_close(out, want)


def test_the_fused_nhwc_norm_of_a_block_is_instance_norm_when_the_block_is_the_field():
    """InstanceNormNHWCBlocks with the identity as the blocks' total: F.instance_norm's values
    and gradients (float64), and gradcheck; |mean| >> std included (two-pass variance)."""
    from diffnet.norms import InstanceNormNHWCBlocks

    torch.manual_seed(0)
    x = (torch.randn(2, 3, 6, 5, dtype=torch.float64) + torch.tensor([0.0, 1e4, -3.0],
         dtype=torch.float64).view(1, 3, 1, 1)).contiguous(memory_format=torch.channels_last)
    w = torch.randn(3, dtype=torch.float64)
    b = torch.randn(3, dtype=torch.float64)
    args = [t.clone().requires_grad_() for t in (x, w, b)]
    y = InstanceNormNHWCBlocks.apply(args[0], args[1], args[2], 1e-5, lambda t: t, 30)
    ref_args = [t.clone().requires_grad_() for t in (x, w, b)]
    ref = torch.nn.functional.instance_norm(ref_args[0], weight=ref_args[1], bias=ref_args[2],
                                            eps=1e-5)
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(ref)
    (y * g).sum().backward()
    (ref * g).sum().backward()
    for a, r in zip(args, ref_args):
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-8, atol=1e-8)
    small = [t[:1, :, :4, :3].contiguous(memory_format=torch.channels_last) if t.dim() == 4
             else t for t in (x, w, b)]
    small[0] = small[0] - small[0].mean()
    assert torch.autograd.gradcheck(
        lambda a, c, d: InstanceNormNHWCBlocks.apply(a, c, d, 1e-5, lambda t: t, 12),
        [t.clone().requires_grad_() for t in small])


@pytest.mark.parametrize("fmt,dims", [(torch.contiguous_format, 2), (torch.channels_last, 2),
                                      (torch.contiguous_format, 3)])
def test_low_precision_inference_norm_in_slabs_is_the_float32_norm(monkeypatch, fmt, dims):
    """A bf16 model's split norm without autograd works a slab of rows at a time (forced to
    2 rows, 3-4 slabs); its values are the float32 norm's rounded to bf16, |mean| >> std included."""
    import diffnet.split_layers as sl
    from diffnet.norms import InstanceNorm

    torch.manual_seed(0)
    grid = (7, 6) if dims == 2 else (5, 4, 3)
    x = torch.randn(2, 3, *grid) + torch.tensor([0.0, 50.0, -3.0]).view(1, 3, *(1,) * dims)
    x = x.to(torch.bfloat16).contiguous(memory_format=fmt)
    norm = InstanceNorm(3)
    with torch.no_grad():
        norm.weight.normal_(), norm.bias.normal_()
    split = rebuild(norm, sl.SplitInstanceNorm, Block(grid)).to(torch.bfloat16)
    want = torch.nn.functional.instance_norm(x.float(), weight=split.weight.float(),
                                             bias=split.bias.float(), eps=norm.eps)
    monkeypatch.setattr(sl, "SLAB_ELEMENTS", 2 * 2 * 3 * x[0, 0, 0].numel())
    with torch.no_grad():
        got = split(x)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    # bf16 keeps 8 bits: outputs of size ~3 round by <= 2^-7 * 4
    torch.testing.assert_close(got.float(), want.to(torch.bfloat16).float(), rtol=0, atol=0.035)
