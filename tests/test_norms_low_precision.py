"""The low-precision NHWC instance norm (diffnet.norms.InstanceNormNHWCLowPrecision): bf16/fp16
channels_last activations, statistics in float32, every pass over the field in the input's
dtype. Checked against float64 instance norm of the same (rounded) input."""
import pytest
import torch
import torch.nn.functional as F

from diffnet.norms import InstanceNorm

EPS = 1e-5

# (shape, mean, std): C = 16 takes the widest row tiling; n = 60 and n = 63 are one partial
# sum (63 is odd: no tiling); |mean| / std = 50 and 1000 would cancel without the centring
CASES = {
    "centred": ((2, 16, 64, 64), 0.0, 1.0),
    "mean>>std": ((2, 16, 32, 32), 50.0, 1.0),
    "mean>>>std": ((2, 8, 16, 16), 1000.0, 1.0),
    "small": ((3, 24, 10, 6), 3.0, 2.0),
    "odd": ((1, 5, 7, 9), -1.0, 0.5),
    "large": ((1, 8, 256, 512), 0.5, 3.0),
}
# max error / max |reference|: bf16 rounds each value to 2^-9 relative; the output, its
# gradient and the statistics each carry a few such roundings. The bf16 model's norm before
# this kernel (the float32 kernel's arithmetic in bf16) was 4.4e-2 off at |mean|/std = 50.
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _reference(x, weight, bias, g):
    """Output and gradients of F.instance_norm in float64 on the same low-precision input."""
    x64 = x.detach().double().requires_grad_()
    w64, b64 = (t.detach().double().requires_grad_() for t in (weight, bias))
    y = F.instance_norm(x64.contiguous(), weight=w64, bias=b64, eps=EPS)
    y.backward(g.double())
    return y.detach(), x64.grad, w64.grad, b64.grad


def _rel(actual, expected):
    return ((actual.double() - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_low_precision_norm_matches_float64_to_rounding(case, dtype):
    shape, mean, std = CASES[case]
    gen = torch.Generator().manual_seed(3)
    x = (mean + std * torch.randn(shape, generator=gen)).to(dtype)
    x = x.contiguous(memory_format=torch.channels_last).requires_grad_()
    norm = InstanceNorm(shape[1])
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=gen)
        norm.bias.normal_(generator=gen)
    g = torch.randn(shape, generator=gen).to(dtype)
    y = norm(x)
    assert type(y.grad_fn).__name__ == "InstanceNormNHWCLowPrecisionBackward"
    assert y.dtype == dtype and y.is_contiguous(memory_format=torch.channels_last)
    y.backward(g)
    assert x.grad.dtype == dtype and norm.weight.grad.dtype == torch.float32
    ref = _reference(x, norm.weight, norm.bias, g)
    for name, a, e in zip(("output", "grad x", "grad weight", "grad bias"),
                          (y.detach(), x.grad, norm.weight.grad, norm.bias.grad), ref):
        assert _rel(a, e) <= TOL[dtype], f"{name}: {_rel(a, e):.2e} > {TOL[dtype]:g}"


def test_bf16_autocast_keeps_the_norm_in_bf16_and_float32_input_in_float32():
    """Under bf16 autocast a convolution hands the norm bf16, and the norm hands bf16 on (no
    float32 round trip); float32 input keeps the float32 kernel, autocast or not."""
    conv = torch.nn.Conv2d(3, 16, 3, padding=1).to(memory_format=torch.channels_last)
    norm = InstanceNorm(16)
    x = torch.randn(2, 3, 16, 16).contiguous(memory_format=torch.channels_last)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = norm(conv(x))
        y32 = norm(torch.randn(2, 16, 8, 8).contiguous(memory_format=torch.channels_last))
    assert y.dtype == torch.bfloat16
    assert type(y.grad_fn).__name__ == "InstanceNormNHWCLowPrecisionBackward"
    assert y32.dtype == torch.float32 and type(y32.grad_fn).__name__ == "InstanceNormNHWCBackward"
    y.float().sum().backward()
    assert torch.isfinite(conv.weight.grad).all() and norm.weight.grad.dtype == torch.float32
