"""Generators: networks mapping a problem's input fields (B, C, H, W) to a solution (B, 1, H, W).

The U-Net follows the DiffNet generator: an encoder of ``depth`` downsampling levels, each two
3x3 convolutions + norm + activation with widths doubling from ``base_width`` up to
``max_width``, a decoder that upsamples and concatenates the encoder's skip at every level, and
a 1x1 output convolution. Instance norm only: batch norm would couple the samples of a batch
(and, under data parallelism, the ranks), so a sample's output would depend on its batch mates.

Registry: ``GENERATORS`` maps names to classes; ``build_generator(name, **kwargs)`` builds one,
and ``build_generator(name, **model.config())`` rebuilds a model (checkpoints store both).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .validation import check_bool, check_choice, check_int

NORMS = ("instance", "none")
ACTIVATIONS = {
    "gelu": nn.GELU,
    "relu": nn.ReLU,
    "silu": nn.SiLU,
    "tanh": nn.Tanh,
    "leaky_relu": lambda: nn.LeakyReLU(0.2),
}
DOWNSAMPLES = ("conv", "avgpool")
UPSAMPLES = ("bilinear", "transpose")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A channels_last (B, C, H, W) tensor as its (B, H*W, C) contiguous view (no copy)."""
    b, c, h, w = t.shape
    return t.permute(0, 2, 3, 1).reshape(b, h * w, c)


class _InstanceNormNHWC(torch.autograd.Function):
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
        xr = _rows(x)
        ones = x.new_ones(b, 1, n)
        shift = xr[:, :1]
        d = xr - shift
        m1 = torch.bmm(ones, d) / n                                   # (B, 1, C)
        var = (torch.bmm(ones, d * d) / n - m1 * m1).clamp_min(0)
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
        gr = _rows(g.to(x.dtype).contiguous(memory_format=torch.channels_last))
        xr = _rows(x)
        ones = x.new_ones(b, 1, n)
        sg = torch.bmm(ones, gr)                                      # sum g
        sgxh = (torch.bmm(ones, gr * xr) - mean * sg) * rstd          # sum g * xhat
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
    """Affine instance norm (per sample, per channel over H, W; biased variance), the same
    function and parameters (``weight``, ``bias``) as ``nn.InstanceNorm2d(c, affine=True)``.

    channels_last input takes the NHWC kernel above; other input takes ATen's group norm with
    one channel per group (the same statistics, and faster than instance_norm on CPU).
    """

    def __init__(self, num_features: int, eps: float = 1e-5):
        super().__init__()
        self.num_features, self.eps = num_features, eps
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4 and not x.is_contiguous() and \
                x.is_contiguous(memory_format=torch.channels_last):
            return _InstanceNormNHWC.apply(x, self.weight, self.bias, self.eps)
        return F.group_norm(x, self.num_features, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, affine=True"


class ConvBlock(nn.Sequential):
    """Two (3x3 conv, norm, activation) layers at one resolution."""

    def __init__(self, c_in: int, c_out: int, norm: str, activation: str):
        layers = []
        for c in (c_in, c_out):
            # The affine instance norm supplies the shift, so the conv needs no bias.
            layers.append(nn.Conv2d(c, c_out, 3, padding=1, bias=norm == "none"))
            if norm == "instance":
                layers.append(InstanceNorm(c_out))
            layers.append(ACTIVATIONS[activation]())
        super().__init__(*layers)


class Down(nn.Module):
    """Halve the resolution (stride-2 3x3 conv, or 2x2 average pooling), then a ConvBlock."""

    def __init__(self, c_in: int, c_out: int, norm: str, activation: str, downsample: str):
        super().__init__()
        self.pool = (nn.Conv2d(c_in, c_in, 3, stride=2, padding=1) if downsample == "conv"
                     else nn.AvgPool2d(2))
        self.block = ConvBlock(c_in, c_out, norm, activation)

    def forward(self, x):
        return self.block(self.pool(x))


class Up(nn.Module):
    """Double the resolution, concatenate the encoder skip, then a ConvBlock."""

    def __init__(self, c_in: int, c_skip: int, c_out: int, norm: str, activation: str,
                 upsample: str):
        super().__init__()
        # Bilinear upsampling is parameter-free; the ConvBlock after it mixes channels.
        self.up = (nn.ConvTranspose2d(c_in, c_in, 2, stride=2) if upsample == "transpose"
                   else nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False))
        self.block = ConvBlock(c_in + c_skip, c_out, norm, activation)

    def forward(self, x, skip):
        return self.block(torch.cat([self.up(x), skip], dim=1))


class UNet(nn.Module):
    """U-Net generator (B, in_channels, H, W) -> (B, out_channels, H, W).

    Args:
        in_channels: number of input fields (the problem's ``input_channels``).
        out_channels: number of output fields (1 for a scalar PDE).
        depth: number of downsampling levels; H and W must be divisible by 2**depth.
        base_width: channels at full resolution; level l has min(base_width * 2**l, max_width).
        max_width: cap on the channel count of the deep levels.
        norm: "instance" (per sample, per channel; affine) or "none". No batch norm.
        activation: one of "gelu", "relu", "silu", "tanh", "leaky_relu" (slope 0.2).
        downsample: "conv" (learned stride-2 3x3 conv) or "avgpool".
        upsample: "bilinear" (parameter-free) or "transpose" (2x2 stride-2 transposed conv).
        checkpoint_levels: recompute each level's activations in backward
            (torch.utils.checkpoint, use_reentrant=False) to save memory on large grids; same
            outputs and gradients, about one extra forward of compute.

    The default (depth 4, widths 16, 32, 64, 128, 128, conv downsampling, bilinear
    upsampling, one input channel) has 1,422,097 parameters, the size class of the published
    DiffNet generator (~2M with depth 5: 2,307,985).

    Instance norm needs more than one node per channel in training, so with norm="instance"
    the coarsest level must be at least 2 nodes in total: H * W >= 2 * 4**depth.
    """

    def __init__(self, *, in_channels: int, out_channels: int = 1, depth: int = 4,
                 base_width: int = 16, max_width: int = 128, norm: str = "instance",
                 activation: str = "gelu", downsample: str = "conv", upsample: str = "bilinear",
                 checkpoint_levels: bool = False):
        super().__init__()
        self._config = dict(
            in_channels=check_int("in_channels", in_channels, 1),
            out_channels=check_int("out_channels", out_channels, 1),
            depth=check_int("depth", depth, 0, 10),
            base_width=check_int("base_width", base_width, 1),
            max_width=check_int("max_width", max_width, 1),
            norm=check_choice("norm", norm, NORMS),
            activation=check_choice("activation", activation, ACTIVATIONS),
            downsample=check_choice("downsample", downsample, DOWNSAMPLES),
            upsample=check_choice("upsample", upsample, UPSAMPLES),
            checkpoint_levels=check_bool("checkpoint_levels", checkpoint_levels),
        )
        c = self._config
        if c["max_width"] < c["base_width"]:
            raise ValueError(f"max_width must be >= base_width ({base_width}), got {max_width}")
        self.depth = c["depth"]
        self.checkpoint_levels = c["checkpoint_levels"]
        self.widths = [min(c["base_width"] * 2**level, c["max_width"])
                       for level in range(self.depth + 1)]
        self._build(c["in_channels"], c["out_channels"], norm, activation, downsample, upsample)

    def _build(self, c_in, c_out, norm, activation, downsample, upsample):
        w = self.widths
        self.inc = ConvBlock(c_in, w[0], norm, activation)
        self.downs = nn.ModuleList(
            Down(w[i], w[i + 1], norm, activation, downsample) for i in range(self.depth))
        # ups[i] goes from level i+1 to level i; applied deepest first.
        self.ups = nn.ModuleList(
            Up(w[i + 1], w[i], w[i], norm, activation, upsample) for i in range(self.depth))
        self.outc = nn.Conv2d(w[0], c_out, 1)

    def config(self) -> dict:
        """Constructor keyword arguments (JSON-serialisable) that rebuild this network."""
        return dict(self._config)

    def check_input(self, x: torch.Tensor) -> None:
        """Raise ValueError unless x is (B, in_channels, H, W) with H, W multiples of 2**depth."""
        c_in = self._config["in_channels"]
        if x.dim() != 4 or x.shape[1] != c_in:
            raise ValueError(f"input must have shape (B, {c_in}, H, W), got {tuple(x.shape)}")
        h, w = x.shape[2:]
        m = 2**self.depth
        if h % m or w % m:
            near = [sorted({max(m, n // m * m), -(-n // m) * m}) for n in (h, w)]
            raise ValueError(
                f"grid {h}x{w} is not divisible by 2**depth = {m} (depth={self.depth}); "
                f"nearest valid sizes: H in {near[0]}, W in {near[1]} (or lower depth)")
        if self._config["norm"] == "instance" and self.training and h * w < 2 * m * m:
            raise ValueError(
                f"grid {h}x{w} with depth={self.depth} leaves a 1x1 coarsest level, on which "
                f"instance norm is undefined; use a larger grid or depth <= "
                f"{max(0, (max(h, w) // 2).bit_length() - 1)}")

    def _run(self, module, *args):
        # Checkpointing only pays when a backward pass will follow.
        if self.checkpoint_levels and torch.is_grad_enabled():
            return checkpoint(module, *args, use_reentrant=False)
        return module(*args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check_input(x)
        skips = [self._run(self.inc, x)]
        for down in self.downs:
            skips.append(self._run(down, skips[-1]))
        y = skips.pop()
        for up in reversed(self.ups):
            y = self._run(up, y, skips.pop())
        return self.outc(y)


class UNetSmall(UNet):
    """A lighter U-Net for quick CPU runs and tests: depth 3, widths 8..64 by default."""

    def __init__(self, *, in_channels: int, out_channels: int = 1, depth: int = 3,
                 base_width: int = 8, max_width: int = 64, **kwargs):
        super().__init__(in_channels=in_channels, out_channels=out_channels, depth=depth,
                         base_width=base_width, max_width=max_width, **kwargs)


GENERATORS: dict[str, type] = {"unet": UNet, "unet-small": UNetSmall}


def build_generator(name: str, **kwargs) -> nn.Module:
    """Instantiate the registered generator ``name`` with keyword arguments ``kwargs``."""
    return GENERATORS[check_choice("generator name", name, sorted(GENERATORS))](**kwargs)


def impose_dirichlet(u: torch.Tensor, mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Hard-impose values where mask is 1: ``u * (1 - mask) + values * mask``.

    mask is 1 on the constrained nodes and 0 elsewhere (fractional values blend); all three
    broadcast against each other. values must be finite everywhere (0 * nan is nan). Gradients
    reach u only through the unconstrained nodes, so the network never fights the boundary.
    """
    if mask.dtype == torch.bool:
        mask = mask.to(u.dtype)
    return u * (1 - mask) + values * mask


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
