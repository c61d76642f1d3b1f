"""Instance normalisation for the generators: the affine per-sample, per-channel norm of 4-D
(2-D grids) and 5-D (3-D grids) activations, with fused NHWC paths for 4-D channels_last
tensors (the memory format oneDNN's convolutions prefer): one for float32/float64, one for
bfloat16/float16 activations (bf16 autocast in training, a bf16 model in inference).

Instance norm only in this package: batch norm would couple the samples of a batch (and, under
data parallelism, the ranks), so a sample's output would depend on its batch mates.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rows_view(t: torch.Tensor) -> torch.Tensor:
    """A channels_last (B, C, H, W) tensor as its (B, H*W, C) contiguous view (no copy)."""
    b, c, h, w = t.shape
    return t.permute(0, 2, 3, 1).reshape(b, h * w, c)


# Rows per GEMM in the norms' sums: a single (1 x H*W) @ (H*W x C) GEMM accumulates millions
# of fp32 terms in long runs (measured: the variance 0.9% off at 2048x2048, 3e-5 relative error
# in a sum at 1024x1024); GEMMs over chunks of <= 4096 rows, then a sum of the chunk sums, are
# accurate to ~1e-7 and cost a little more than the single GEMM (less than torch's own reduction).
ROWS_PER_SUM = 4096


def row_sums(t: torch.Tensor) -> torch.Tensor:
    """(B, N, C) -> (B, 1, C): the sums over N, as GEMMs of a ones row over chunks of rows."""
    b, n, c = t.shape
    if n <= ROWS_PER_SUM:
        return torch.bmm(t.new_ones(b, 1, n), t)
    k = next((k for k in range(ROWS_PER_SUM, ROWS_PER_SUM // 4, -1) if n % k == 0), 0)
    if not k or not t.is_contiguous():
        return t.sum(1, keepdim=True)
    m = n // k
    parts = torch.bmm(t.new_ones(b * m, 1, k), t.view(b * m, k, c))
    return parts.view(b, m, c).sum(1, keepdim=True)


class InstanceNormNHWC(torch.autograd.Function):
    """Affine instance norm of a channels_last tensor with every pass in NHWC.

    ATen's instance/group norm on channels_last input is several times slower than on NCHW
    (instance norm even copies to NCHW and back), so a channels_last U-Net would spend more time
    in its norms than it saves in its convolutions. Here the per-(sample, channel) sums over
    H*W are batched GEMMs of a ones row with the (B, H*W, C) view, and the normalisation and its
    gradient are one fused multiply-add each. The variance uses a per-channel shift (one sample
    of the channel) so E[d^2] - E[d]^2 does not cancel when |mean| >> std.
    """

    @staticmethod
    # bf16/fp16 input takes InstanceNormNHWCLowPrecision; under autocast this one stays float32
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x, weight, bias, eps):
        b, c, h, w = x.shape
        n = h * w
        xr = rows_view(x)
        shift = xr[:, :1]
        d = xr - shift
        m1 = row_sums(d) / n                                   # (B, 1, C)
        var = (row_sums(d * d) / n - m1 * m1).clamp_min(0)
        del d
        mean = shift + m1
        rstd = (var + eps).rsqrt()
        scale = weight.view(1, 1, c) * rstd
        y = torch.addcmul(bias.view(1, 1, c) - mean * scale, xr, scale)
        ctx.save_for_backward(x, mean, rstd, weight)
        return y.view(b, h, w, c).permute(0, 3, 1, 2)

    @staticmethod
    @torch.autograd.function.once_differentiable  # mean/rstd are saved without a graph
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        x, mean, rstd, weight = ctx.saved_tensors
        b, c, h, w = x.shape
        n = h * w
        gr = rows_view(g.to(x.dtype).contiguous(memory_format=torch.channels_last))
        xr = rows_view(x)
        sg = row_sums(gr)                                             # sum g
        sgxh = (row_sums(gr * xr) - mean * sg) * rstd                 # sum g * xhat
        gw = sgxh.sum(0).view(c) if ctx.needs_input_grad[1] else None
        gb = sg.sum(0).view(c) if ctx.needs_input_grad[2] else None
        gx = None
        if ctx.needs_input_grad[0]:
            # gx = scale * (g - sum(g)/n - xhat * sum(g xhat)/n) = scale * g + k1 * x + k0
            scale = weight.view(1, 1, c) * rstd
            k1 = -scale * rstd * sgxh / n
            k0 = -scale * sg / n - k1 * mean
            gx = torch.addcmul(k0, gr, scale).addcmul_(xr, k1)
            gx = gx.view(b, h, w, c).permute(0, 3, 1, 2)
        return gx, gw, gb, None


LOW_PRECISION = (torch.bfloat16, torch.float16)

# Broadcast elementwise ops over (B, N, C) with a (B, 1, C) per-channel vector run far below
# memory speed when C is 16-32 (ATen's inner loop is one row of C elements; bf16 is slower
# still); viewed as rows of >= 256 elements with the vector tiled k times they run near it.
WIDE_ROW = 256


def tiled(t: torch.Tensor, *vectors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(B, N, C) rows and (B or 1, 1, C) per-channel vectors as (B, N/k, kC) rows and
    (B, 1, kC) vectors in ``t``'s dtype: the same elementwise arithmetic on wider rows."""
    b, n, c = t.shape
    k = 1
    while k * c < WIDE_ROW and n % (2 * k) == 0:
        k *= 2
    return (t.view(b, n // k, k * c),) + tuple(
        v.to(t.dtype).expand(b, 1, c).repeat(1, 1, k) for v in vectors)


def affine(t: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """t * scale + offset per channel, in ``t``'s dtype ((B, N, C) rows, (B, 1, C) vectors)."""
    wide, s, o = tiled(t, scale, offset)
    return torch.addcmul(o, wide, s).view(t.shape)


# Rows per partial sum in the low-precision norm: each partial sum is rounded once to the
# input's dtype (bf16: <= 2^-9 relative), then the partials are added in float32. A float32
# sum of the whole field is ~1e-7 accurate but copies the field to float32 first (a visible share
# of a bf16 step in a profile; lab/notes/performance.md, "The bf16 step's norms in bf16").
ROWS_PER_PARTIAL = 256


def partial_sums(t: torch.Tensor) -> torch.Tensor:
    """(B, N, C) -> (B, 1, C) float32 sums over N, from partial sums of <= ROWS_PER_PARTIAL rows
    in ``t``'s dtype (accumulated in float32 by ATen, rounded once each)."""
    b, n, c = t.shape
    k = min(ROWS_PER_PARTIAL, n)
    while n % k:
        k -= 1
    return t.view(b, n // k, k, c).sum(2).float().sum(1, keepdim=True)


class InstanceNormNHWCLowPrecision(torch.autograd.Function):
    """Affine instance norm of a bfloat16 or float16 channels_last tensor: the statistics and
    the per-channel coefficients in float32, every pass over the field in the input's dtype.

    Under bf16 autocast the float32 kernel above costs two dtype copies of every activation and
    moves float32 through the norm and the activation after it; this one keeps them in bf16
    and the bf16 step is faster for it (``python -m bench.step_bench --bf16`` times both: row
    ``deepfusion_bf16_fp32_norm`` is the step with the float32 kernel). The field is first
    centred on the mean of a strided subsample of >= 256 of its nodes (``d = x - shift``: exact
    near the mean, so |mean| >> std does not cancel, and E[d^2] is var to ~1%, so its rounding
    does not grow);
    ``d`` is what backward keeps. The statistics are then accurate to ~2e-3 relative in bf16
    (partial sums rounded once each, the squares rounded), the size of the output's own
    rounding (2^-9 relative).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        b, c, h, w = x.shape
        n = h * w
        xr = rows_view(x)
        subsample = xr[:, ::max(1, n // ROWS_PER_PARTIAL)]
        wide, shift = tiled(xr, subsample.float().mean(1, keepdim=True))
        d = (wide - shift).view(xr.shape)
        m1 = partial_sums(d) / n                                        # (B, 1, C), float32
        var = (partial_sums(d * d) / n - m1 * m1).clamp_min(0)
        rstd = (var + eps).rsqrt()
        scale = weight.float().view(1, 1, c) * rstd
        y = affine(d, scale, bias.float().view(1, 1, c) - m1 * scale)
        ctx.save_for_backward(d, m1, rstd, weight)
        return y.view(b, h, w, c).permute(0, 3, 1, 2)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        d, m1, rstd, weight = ctx.saved_tensors
        b, n, c = d.shape
        h, w = g.shape[2:]
        gr = rows_view(g.to(d.dtype).contiguous(memory_format=torch.channels_last))
        sg = partial_sums(gr)                                           # sum g
        sgxh = (partial_sums(gr * d) - m1 * sg) * rstd                  # sum g * xhat
        gw = sgxh.sum(0).view(c).to(weight.dtype) if ctx.needs_input_grad[1] else None
        gb = sg.sum(0).view(c).to(weight.dtype) if ctx.needs_input_grad[2] else None
        gx = None
        if ctx.needs_input_grad[0]:
            # gx = scale * g + k1 * d + k0 (the float32 kernel's formula, centred on the shift)
            scale = weight.float().view(1, 1, c) * rstd
            k1 = -scale * rstd * sgxh / n
            gx = affine(gr, scale, -scale * sg / n - k1 * m1)
            wide, k1_wide = tiled(d, k1)
            gx.view(wide.shape).addcmul_(wide, k1_wide)
            gx = gx.view(b, h, w, c).permute(0, 3, 1, 2)
        return gx, gw, gb, None


class InstanceNorm(nn.Module):
    """Affine instance norm (per sample, per channel over the spatial axes; biased variance),
    the same function and parameters (``weight``, ``bias``) as
    ``nn.InstanceNorm2d(c, affine=True)`` on (B, C, H, W) and ``nn.InstanceNorm3d`` on
    (B, C, D, H, W).

    4-D channels_last input takes an NHWC kernel above (the low-precision one for bf16/fp16
    input: under bf16 autocast the convolutions hand the norm bf16); any other input takes
    ATen's group norm with one channel per group (the same statistics, and faster than
    instance_norm on CPU). 5-D channels_last_3d input is normalised as an NCDHW copy and
    handed back in channels_last_3d: ATen's NDHWC group norm cancels (one-pass variance) and
    its backward is an order of magnitude slower; the two copies cost less than that, so a 3-D
    U-Net step is faster this way.
    """

    def __init__(self, num_features: int, eps: float = 1e-5):
        super().__init__()
        self.num_features, self.eps = num_features, eps
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4 and not x.is_contiguous() and \
                x.is_contiguous(memory_format=torch.channels_last):
            nhwc = InstanceNormNHWCLowPrecision if x.dtype in LOW_PRECISION else InstanceNormNHWC
            return nhwc.apply(x, self.weight, self.bias, self.eps)
        if x.dim() == 5 and not x.is_contiguous() and \
                x.is_contiguous(memory_format=torch.channels_last_3d):
            # ATen's group norm on NDHWC input takes a one-pass variance (relative error ~1e-6 in
            # float64 at |mean|/std = 1e5) and a much slower backward: run it on an NCDHW copy.
            y = F.group_norm(x.contiguous(), self.num_features, self.weight, self.bias, self.eps)
            return y.contiguous(memory_format=torch.channels_last_3d)
        return F.group_norm(x, self.num_features, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, affine=True"


class InstanceNormNHWCBlocks(torch.autograd.Function):
    """:class:`InstanceNormNHWC` on one block of a field split over ranks (domain parallelism):
    the per-(sample, channel) statistics are those of the WHOLE field, from the blocks' sums
    added by ``total`` (an all-reduce over the blocks; ``n`` nodes in the whole field).

    Two passes, each one all-reduce: the mean, then the sum of squared deviations (the
    undivided kernel's one-sample shift would differ between blocks). The backward needs the
    whole field's sum(g) and sum(g * xhat): one all-reduce of both; the weight and bias
    gradients stay this block's parts (the engine sums parameter gradients over the ranks).
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x, weight, bias, eps, total, n):
        b, c, h, w = x.shape
        xr = rows_view(x)
        mean = total(row_sums(xr)) / n                                # (B, 1, C)
        d = xr - mean
        var = total(row_sums(d * d)) / n
        del d
        rstd = (var + eps).rsqrt()
        scale = weight.view(1, 1, c) * rstd
        y = torch.addcmul(bias.view(1, 1, c) - mean * scale, xr, scale)
        ctx.save_for_backward(x, mean, rstd, weight)
        ctx.total, ctx.n = total, n
        return y.view(b, h, w, c).permute(0, 3, 1, 2)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        x, mean, rstd, weight = ctx.saved_tensors
        b, c, h, w = x.shape
        gr = rows_view(g.to(x.dtype).contiguous(memory_format=torch.channels_last))
        xr = rows_view(x)
        sg = row_sums(gr)                                             # this block's sum g
        sgxh = (row_sums(gr * xr) - mean * sg) * rstd                 # ... and sum g * xhat
        gw = sgxh.sum(0).view(c) if ctx.needs_input_grad[1] else None
        gb = sg.sum(0).view(c) if ctx.needs_input_grad[2] else None
        gx = None
        if ctx.needs_input_grad[0]:
            both = ctx.total(torch.cat([sg, sgxh], dim=2))           # the whole field's sums
            sg, sgxh = both[..., :c], both[..., c:]
            scale = weight.view(1, 1, c) * rstd
            k1 = -scale * rstd * sgxh / ctx.n
            k0 = -scale * sg / ctx.n - k1 * mean
            gx = torch.addcmul(k0, gr, scale).addcmul_(xr, k1)
            gx = gx.view(b, h, w, c).permute(0, 3, 1, 2)
        return gx, gw, gb, None, None, None
