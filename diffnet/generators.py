"""Generators: networks mapping a problem's input fields (B, C, H, W) to a solution (B, 1, H, W),
or (B, C, D, H, W) to (B, 1, D, H, W) on a 3-D grid.

The U-Net follows the DiffNet generator: an encoder of ``depth`` downsampling levels, each two
3x3 convolutions + norm + activation with widths doubling from ``base_width`` up to
``max_width``, a decoder that upsamples and concatenates the encoder's skip at every level, and
a 1x1 output convolution. :class:`UNet3D` is the same network with 3x3x3 convolutions,
2x2x2 down/upsampling and trilinear upsampling, for 3-D node grids. Instance norm only: batch
norm would couple the samples of a batch (and, under data parallelism, the ranks), so a
sample's output would depend on its batch mates.

:class:`Prolonged` carries a network trained on a coarse grid to a finer grid (a multigrid
schedule's ``prolong``): the coarse answer, interpolated, plus a correction network.

Registry: ``GENERATORS`` maps names to classes; ``build_generator(name, **kwargs)`` builds one,
and ``build_generator(name, **model.config())`` rebuilds a model (checkpoints store both).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from diffnet.norms import InstanceNorm
from diffnet.resample import resample_nodes
from diffnet.validation import check_bool, check_choice, check_int

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
UPSAMPLES_3D = ("trilinear", "transpose")
# The layers of each spatial dimension: convolution, transposed convolution, average pooling.
LAYERS = {2: (nn.Conv2d, nn.ConvTranspose2d, nn.AvgPool2d),
          3: (nn.Conv3d, nn.ConvTranspose3d, nn.AvgPool3d)}


class ConvBlock(nn.Sequential):
    """Two (3x3 conv, norm, activation) layers at one resolution (3x3x3 with dims=3)."""

    def __init__(self, c_in: int, c_out: int, norm: str, activation: str, dims: int = 2):
        conv = LAYERS[dims][0]
        layers = []
        for c in (c_in, c_out):
            # The affine instance norm supplies the shift, so the conv needs no bias.
            layers.append(conv(c, c_out, 3, padding=1, bias=norm == "none"))
            if norm == "instance":
                layers.append(InstanceNorm(c_out))
            layers.append(ACTIVATIONS[activation]())
        super().__init__(*layers)


class Down(nn.Module):
    """Halve the resolution (stride-2 3x3 conv, or 2x2 average pooling), then a ConvBlock."""

    def __init__(self, c_in: int, c_out: int, norm: str, activation: str, downsample: str,
                 dims: int = 2):
        super().__init__()
        conv, _, pool = LAYERS[dims]
        self.pool = (conv(c_in, c_in, 3, stride=2, padding=1) if downsample == "conv"
                     else pool(2))
        self.block = ConvBlock(c_in, c_out, norm, activation, dims)

    def forward(self, x):
        return self.block(self.pool(x))


def memory_format_of(x: torch.Tensor) -> torch.memory_format:
    """The memory format ``x`` is dense in: channels_last(_3d) if only that, else contiguous."""
    if not x.is_contiguous():
        for fmt in (torch.channels_last, torch.channels_last_3d):
            if x.dim() == (4 if fmt is torch.channels_last else 5) and \
                    x.is_contiguous(memory_format=fmt):
                return fmt
    return torch.contiguous_format


class DenseGrad(torch.autograd.Function):
    """Identity forward; backward hands on the gradient dense in the forward tensor's memory
    format. Why: the gradient of a ``torch.cat`` input is a channel slice of the concatenated
    gradient, dense in no format, and ATen's bilinear upsample backward takes a several times
    slower generic path on it; one copy here is cheaper (the whole training step: ``python -m
    bench.step_bench``, rows ``deepfusion`` against ``deepfusion_sliced_grad``). Exact: values
    are copied, never changed.
    """

    @staticmethod
    def forward(ctx, x):
        ctx.fmt = memory_format_of(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous(memory_format=ctx.fmt)


class Up(nn.Module):
    """Double the resolution, concatenate the encoder skip, then a ConvBlock."""

    def __init__(self, c_in: int, c_skip: int, c_out: int, norm: str, activation: str,
                 upsample: str, dims: int = 2):
        super().__init__()
        # Bi/trilinear upsampling is parameter-free; the ConvBlock after it mixes channels.
        self.up = (LAYERS[dims][1](c_in, c_in, 2, stride=2) if upsample == "transpose"
                   else nn.Upsample(scale_factor=2, mode=upsample, align_corners=False))
        self.block = ConvBlock(c_in + c_skip, c_out, norm, activation, dims)

    def forward(self, x, skip):
        return self.block(self.merge(x, skip))

    def merge(self, x, skip):
        """The upsampled ``x`` and the skip, concatenated: the ConvBlock's input."""
        up = self.up(x)
        if torch.is_grad_enabled():  # only a backward needs it; a traced forward stays Python-free
            up = DenseGrad.apply(up)
        return torch.cat([up, skip], dim=1)


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

    dims = 2                      # spatial axes of the input: (B, C, H, W)
    upsamples = UPSAMPLES

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
            upsample=check_choice("upsample", upsample, self.upsamples),
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
        w, dims = self.widths, self.dims
        self.inc = ConvBlock(c_in, w[0], norm, activation, dims)
        self.downs = nn.ModuleList(
            Down(w[i], w[i + 1], norm, activation, downsample, dims) for i in range(self.depth))
        # ups[i] goes from level i+1 to level i; applied deepest first.
        self.ups = nn.ModuleList(
            Up(w[i + 1], w[i], w[i], norm, activation, upsample, dims) for i in range(self.depth))
        self.outc = LAYERS[dims][0](w[0], c_out, 1)

    def config(self) -> dict:
        """Constructor keyword arguments (JSON-serialisable) that rebuild this network."""
        return dict(self._config)

    def check_input(self, x: torch.Tensor) -> None:
        """Raise ValueError unless x is (B, in_channels, H, W) (3-D: (B, in_channels, D, H, W))
        with every grid axis a multiple of 2**depth."""
        c_in = self._config["in_channels"]
        axes = "DHW"[-self.dims:]
        if x.dim() != 2 + self.dims or x.shape[1] != c_in:
            raise ValueError(f"input must have shape (B, {c_in}, {', '.join(axes)}), "
                             f"got {tuple(x.shape)}")
        sizes = tuple(int(n) for n in x.shape[2:])
        grid = "x".join(str(n) for n in sizes)
        m = 2**self.depth
        if any(n % m for n in sizes):
            near = [sorted({max(m, n // m * m), -(-n // m) * m}) for n in sizes]
            valid = ", ".join(f"{a} in {v}" for a, v in zip(axes, near))
            raise ValueError(
                f"grid {grid} is not divisible by 2**depth = {m} (depth={self.depth}); "
                f"nearest valid sizes: {valid} (or lower depth)")
        if self._config["norm"] == "instance" and self.training and \
                math.prod(sizes) < 2 * m**self.dims:
            raise ValueError(
                f"grid {grid} with depth={self.depth} leaves a {'x'.join('1' * self.dims)} "
                f"coarsest level, on which instance norm is undefined; use a larger grid or "
                f"depth <= {max(0, (max(sizes) // 2).bit_length() - 1)}")

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


class UNet3D(UNet):
    """The U-Net on 3-D node grids: (B, in_channels, D, H, W) -> (B, out_channels, D, H, W).

    The same network and options as :class:`UNet` (depth, base_width, max_width, norm,
    activation, downsample, checkpoint_levels), with 3x3x3 convolutions, stride-2 3x3x3 or
    2x2x2 average-pool downsampling, and ``upsample`` = "trilinear" (default, parameter-free)
    or "transpose" (2x2x2 stride-2 transposed conv). D, H and W must be divisible by
    2**depth; with norm="instance" the coarsest level needs >= 2 nodes (D H W >= 2 * 8**depth).
    Instance norm of 5-D activations runs ATen's group norm (one channel per group).

    The default (depth 4, widths 16..128, one input channel) has 4,260,913 parameters (the
    3x3x3 kernels hold 3x the weights of the 2-D ones); depth 3, widths 8..64: 401,881.

    Memory format: NCDHW or channels_last_3d (NDHWC) tensors alike, same outputs (5-D norms
    run on an NCDHW copy, see ``InstanceNorm``). channels_last_3d pays for narrow networks
    and not for the default, deep and wide one: its deep levels are 4^3 and 2^3 grids of 128
    channels, where the NDHWC convolutions gain nothing and the copies remain (measured: see
    lab/notes/readme-second-release.md, "Memory format"). Hence: NCDHW unless the network is
    narrow.
    """

    dims = 3                      # spatial axes of the input: (B, C, D, H, W)
    upsamples = UPSAMPLES_3D

    def __init__(self, *, in_channels: int, out_channels: int = 1, depth: int = 4,
                 base_width: int = 16, max_width: int = 128, norm: str = "instance",
                 activation: str = "gelu", downsample: str = "conv", upsample: str = "trilinear",
                 checkpoint_levels: bool = False):
        super().__init__(in_channels=in_channels, out_channels=out_channels, depth=depth,
                         base_width=base_width, max_width=max_width, norm=norm,
                         activation=activation, downsample=downsample, upsample=upsample,
                         checkpoint_levels=checkpoint_levels)


CORRECTION_DEFAULTS = {"depth": 3, "base_width": 16, "max_width": 64}


def generator_name(module: nn.Module) -> str:
    """The registry name of ``module``'s class (exact type: a subclass has its own name)."""
    for name, cls in GENERATORS.items():
        if type(module) is cls:
            return name
    raise ValueError(f"{type(module).__name__} is not a registered generator "
                     f"(registered: {sorted(GENERATORS)})")


class Prolonged(nn.Module):
    """``inner`` (trained on ``inner_grid``) carried to ``grid`` with a correction network:

        y(x) = P(inner(R(x))) + correction([x, P(inner(R(x)))]),

    R: the input fields resampled to ``inner_grid`` (bilinear, node-aligned); P: the inner
    network's output resampled to ``grid``; ``correction``: a shallow U-Net on ``grid`` that sees
    the inputs and the prolonged answer. Why: a fully convolutional network trained at 64x64
    and run as it is at 512x512 sees an eight times smaller part of the domain through the same
    receptive field (on Burgers its error at 128x128 is several times that of its 64x64 answer
    interpolated: lab/notes/readme-second-release.md). Here the coarse network keeps answering
    on the grid it learned on, and the correction learns what that grid cannot hold (a shock's
    position to one fine node). Its last 1x1 convolution starts at zero, so a freshly prolonged
    network answers exactly the interpolated coarse answer and training starts from there.

    Nested (64 -> 128 -> 256: ``Prolonged(Prolonged(unet, 64, 128), 128, 256)``) the coarse
    networks run on their own small grids and the corrections stay shallow, since the
    long-range part (the domain of dependence) is in the coarse answer. On a grid other than
    its own a Prolonged network is its inner network: a V-cycle's way back down trains the
    coarse network itself, and an unrelated grid gets the innermost network's answer.

    Args:
        inner: the coarse network, or its spec ``{"name": ..., "kwargs": {...}}`` (rebuilt
            through the registry; a checkpoint stores the spec).
        inner_grid: the grid ``inner`` runs on when this network answers on ``grid``.
        grid: this network's grid; every axis finer than ``inner_grid``.
        in_channels, out_channels: as the inner network's.
        correction: keyword arguments of the correction U-Net (defaults
            ``CORRECTION_DEFAULTS``: depth 3, widths 16..64); its input is the fields and the
            prolonged solution (in_channels + out_channels channels).
        train_inner: False freezes ``inner`` (no gradients, run under ``no_grad``): only the
            correction trains, and the coarse answer it corrects stays the one trained on
            ``inner_grid`` (training both at a fresh learning rate undoes the coarse
            network's last steps: on Burgers its validation error on its own grid doubled).
    """

    def __init__(self, *, inner, inner_grid, grid, in_channels: int, out_channels: int = 1,
                 correction: dict | None = None, train_inner: bool = True):
        super().__init__()
        if isinstance(inner, dict):
            inner = build_generator(inner["name"], **inner["kwargs"])
        self.inner = inner
        self.inner_grid = tuple(check_int("inner_grid", g, 1) for g in inner_grid)
        self.grid = tuple(check_int("grid", g, 1) for g in grid)
        if len(self.grid) != len(self.inner_grid) or not all(
                f > c for f, c in zip(self.grid, self.inner_grid)):
            raise ValueError(f"grid {list(self.grid)} must be finer on every axis than "
                             f"inner_grid {list(self.inner_grid)}")
        self.in_channels = check_int("in_channels", in_channels, 1)
        self.out_channels = check_int("out_channels", out_channels, 1)
        self.correction_kwargs = {**CORRECTION_DEFAULTS, **(correction or {})}
        try:
            self.correction = build_generator(
                "unet3d" if len(self.grid) == 3 else "unet", in_channels=in_channels + out_channels,
                out_channels=out_channels, **self.correction_kwargs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"correction network {self.correction_kwargs}: {e}") from None
        with torch.no_grad():  # starts as the identity on the prolonged answer
            self.correction.outc.weight.zero_()
            self.correction.outc.bias.zero_()
        self.train_inner = check_bool("train_inner", train_inner)
        if not train_inner:  # (true leaves a frozen network deeper in a nested inner frozen)
            self.inner.requires_grad_(False)

    def config(self) -> dict:
        """Constructor keyword arguments (JSON-serialisable) that rebuild this network."""
        return {"inner": {"name": generator_name(self.inner), "kwargs": self.inner.config()},
                "inner_grid": list(self.inner_grid), "grid": list(self.grid),
                "in_channels": self.in_channels, "out_channels": self.out_channels,
                "correction": dict(self.correction_kwargs), "train_inner": self.train_inner}

    def grids(self) -> list[tuple[int, ...]]:
        """The grids of the chain, coarse to fine: where each network answers as trained."""
        below = self.inner.grids() if isinstance(self.inner, Prolonged) else [self.inner_grid]
        return below + [self.grid]

    def check_input(self, x: torch.Tensor) -> None:
        """Raise ValueError unless every network of the chain takes ``x``'s grid."""
        if tuple(x.shape[2:]) != self.grid:
            self.inner.check_input(x)
            return
        self.inner.check_input(resample_nodes(x, self.inner_grid))
        extra = x.new_zeros((x.shape[0], self.out_channels, *x.shape[2:]))
        try:
            self.correction.check_input(torch.cat([x, extra], dim=1))
        except ValueError as e:
            raise ValueError(f"the correction network on {list(self.grid)}: {e}") from None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[2:]) != self.grid:
            return self.inner(x)
        with torch.set_grad_enabled(self.train_inner and torch.is_grad_enabled()):
            coarse = self.inner(resample_nodes(x, self.inner_grid))
        return self.corrected(x, resample_nodes(coarse, self.grid))

    def corrected(self, x: torch.Tensor, coarse: torch.Tensor) -> torch.Tensor:
        """The answer from the inputs ``x`` and the prolonged coarse answer ``coarse`` (both on
        ``grid``, or both on one block of it under a domain split)."""
        fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        if x.is_contiguous(memory_format=fmt):  # keep the correction's input in x's layout
            coarse = coarse.contiguous(memory_format=fmt)
        return coarse + self.correction(torch.cat([x, coarse], dim=1))


GENERATORS: dict[str, type] = {"unet": UNet, "unet-small": UNetSmall, "unet3d": UNet3D,
                               "prolonged": Prolonged}


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
