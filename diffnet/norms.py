"""Instance normalisation for the generators: the affine per-sample, per-channel norm of 4-D
(2-D grids) and 5-D (3-D grids) activations, with a fused NHWC path for 4-D channels_last
tensors (the memory format oneDNN's convolutions prefer).

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
# accurate to ~1e-7 and cost 1.3-1.5x the single GEMM (torch's own reduction: 2x).
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

    ATen's instance/group norm on channels_last input is 2-4x slower than on NCHW (instance
    norm even copies to NCHW and back), so a channels_last U-Net spent more time in its norms
    than it saved in its convolutions. Here the per-(sample, channel) sums over H*W are batched
    GEMMs of a ones row with the (B, H*W, C) view, and the normalisation and its gradient are
    one fused multiply-add each. The variance uses a per-channel shift (one sample of the
    channel) so E[d^2] - E[d]^2 does not cancel when |mean| >> std.
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)  # norms stay fp32 under bf16 autocast
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


class InstanceNorm(nn.Module):
    """Affine instance norm (per sample, per channel over the spatial axes; biased variance),
    the same function and parameters (``weight``, ``bias``) as
    ``nn.InstanceNorm2d(c, affine=True)`` on (B, C, H, W) and ``nn.InstanceNorm3d`` on
    (B, C, D, H, W).

    4-D channels_last input takes the NHWC kernel above; any other input takes ATen's group
    norm with one channel per group (the same statistics, and faster than instance_norm on
    CPU). 5-D channels_last_3d input is normalised as an NCDHW copy and handed back in
    channels_last_3d: ATen's NDHWC group norm cancels (one-pass variance) and its backward is
    ~10x slower; the two copies cost less (a 3-D U-Net step at 32^3, widths 8..64, is 1.1x faster
    this way than on the NDHWC group norm).
    """

    def __init__(self, num_features: int, eps: float = 1e-5):
        super().__init__()
        self.num_features, self.eps = num_features, eps
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4 and not x.is_contiguous() and \
                x.is_contiguous(memory_format=torch.channels_last):
            return InstanceNormNHWC.apply(x, self.weight, self.bias, self.eps)
        if x.dim() == 5 and not x.is_contiguous() and \
                x.is_contiguous(memory_format=torch.channels_last_3d):
            # ATen's group norm on NDHWC input takes a one-pass variance (relative error ~1e-6 in
            # float64 at |mean|/std = 1e5) and a ~10x slower backward: run it on an NCDHW copy.
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
