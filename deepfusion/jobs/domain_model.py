"""Scaling model for domain-parallel DiffNet training: ONE large sample split over P ranks.

    deepfusion jobs model --domain-grid 4096x4096 --t-sample S --t-sample-grid 2048x2048 --out DIR

P = nodes x ranks_per_node ranks, T threads per rank; the sample's grid is cut into P equal blocks
(``parallel.domain``), every rank runs the whole U-Net on its block. Per training step:

    t_rank       = amdahl(t_sample * N(grid) / N(t_sample_grid), T)   one rank, the whole sample
    t_compute    = t_rank / P                                         N(.) = nodes of a grid
    t_halo       = 2 * sum_layers sum_{a: split_a > 1} 2 * (alpha_a + B_{l,a} / beta_a)
    B_{l,a}      = face_a(block_l) * C_l * 4       one ghost layer of fp32, face_a = the nodes of
                   the block's axis-a face, axes < a counted with their ghosts (corners ride along)
    t_norm       = 4 * sum_norms allreduce(P, 4 C_norm)     2 sums forward (mean, variance), 2 back
    t_grad       = allreduce(P, 4 * parameters)             once per step over all P ranks
    T_step       = t_compute + t_halo + t_norm + t_grad     (no overlap)
    efficiency(n) = T_step(1 node) / (n * T_step(n nodes))

The outer 2 of t_halo: backward sends the ghosts' gradients back, the same volume. Per axis, the
halo is two Sendrecv shifts (up, then down), each one message time whether a block has one or two
neighbours along that axis. allreduce() is deepfusion.jobs.costs.allreduce_time (faster of ring /
recursive doubling, so the norms' small sums cost ceil(log2 P) latencies) on
deepfusion.jobs.costs.link_params.

Layers (the default U-Net, conv downsampling, bilinear/trilinear upsampling): each 3x3 conv of a
ConvBlock, each stride-2 conv, each upsampling exchanges one ghost layer of its input (C_l
channels, block_l = the block at level l, halved per level): 2 + 6 depth layers. 1x1 convs,
activations and concatenation are local. Instance norm after each 3x3 conv: 2 (2 depth + 1).

Links: rank r holds block unravel_index(r, split) (row-major, as deepfusion.engine.parallel.halo) and
lives on node r // ranks_per_node. Axis a uses the shm link when every neighbour pair along it
is on one node, else the network link with its bandwidth shared: beta_a = beta / k_a, k_a = the
most ranks of one node whose neighbour along a is on another node (they send at once).
Split: given, or the valid split of P with the most nearly cubic block (then the larger
counts first, as MPI_Dims_create); valid = every block side a multiple of 2**depth.
"""
from __future__ import annotations

import json
import math
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from deepfusion.jobs.costs import NODES, allreduce_time, amdahl, link_params, plot_efficiency
from deepfusion.jobs.profiles import get_profile, load_profiles

FP32 = 4  # bytes per value


@dataclass(frozen=True)
class Net:
    """The U-Net of diffnet.generators (UNet / UNet3D defaults: depth 4, widths 16..128)."""
    dims: int = 2
    depth: int = 4
    base_width: int = 16
    max_width: int = 128
    in_channels: int = 1
    out_channels: int = 1

    @property
    def widths(self) -> list[int]:
        """Channels of level l: min(base_width * 2**l, max_width)."""
        return [min(self.base_width * 2**lv, self.max_width) for lv in range(self.depth + 1)]


def parse_grid(text: str) -> tuple[int, ...]:
    """'4096x4096' -> (4096, 4096); 2 or 3 positive axes."""
    try:
        grid = tuple(int(v) for v in text.lower().split("x"))
    except ValueError:
        grid = ()
    if len(grid) not in (2, 3) or min(grid) < 1:
        raise ValueError(f"grid {text!r} must be 2 or 3 positive node counts like 4096x4096")
    return grid


# ----------------------------------------------------------------------------- the network
def halo_layers(net: Net) -> list[tuple[int, int]]:
    """(level, channels of the input) of every layer that exchanges one ghost layer."""
    w = net.widths
    out = [(0, net.in_channels), (0, w[0])]                           # inc: two 3x3 convs
    for i in range(net.depth):                                        # Down: stride-2 conv, ConvBlock
        out += [(i, w[i]), (i + 1, w[i]), (i + 1, w[i + 1])]
    for i in range(net.depth):                                        # Up: upsample, ConvBlock
        out += [(i + 1, w[i + 1]), (i, w[i + 1] + w[i]), (i, w[i])]
    return out


def norm_channels(net: Net) -> list[int]:
    """Channels of every instance norm (two per ConvBlock)."""
    w = net.widths
    blocks = [w[0]] + [w[i + 1] for i in range(net.depth)] + [w[i] for i in range(net.depth)]
    return [c for c in blocks for _ in range(2)]


def param_count(net: Net) -> int:
    """Parameters of the U-Net (instance norm: 3x3 convs without bias, 2 C affine per norm)."""
    k, w = 3**net.dims, net.widths

    def block(ci, co):
        return k * ci * co + k * co * co + 4 * co

    n = block(net.in_channels, w[0]) + w[0] * net.out_channels + net.out_channels
    for i in range(net.depth):
        n += k * w[i] * w[i] + w[i] + block(w[i], w[i + 1]) + block(w[i + 1] + w[i], w[i])
    return n


# ----------------------------------------------------------------------------- geometry
def face_nodes(block: tuple[int, ...], axis: int, width: int = 1) -> int:
    """Nodes of the axis-``axis`` face: prod_{b<a}(n_b + 2 width) * prod_{b>a} n_b."""
    return math.prod(n + 2 * width if b < axis else n for b, n in enumerate(block) if b != axis)


def valid_split(grid, split, depth: int) -> bool:
    return all(g % (s * 2**depth) == 0 for g, s in zip(grid, split))


def factorizations(p: int, dims: int) -> list[tuple[int, ...]]:
    """Every ordered tuple of ``dims`` positive integers whose product is p."""
    if dims == 1:
        return [(p,)]
    return [(d,) + rest for d in range(1, p + 1) if p % d == 0 for rest in factorizations(p // d, dims - 1)]


def choose_split(grid, p: int, depth: int) -> tuple[int, ...] | None:
    """The valid split of p blocks with the smallest max/min block side (ties: larger counts first)."""
    ok = [s for s in factorizations(p, len(grid)) if valid_split(grid, s, depth)]
    if not ok:
        return None
    aspect = {s: max(g // k for g, k in zip(grid, s)) / min(g // k for g, k in zip(grid, s)) for s in ok}
    return min(ok, key=lambda s: (aspect[s], [-k for k in s]))


def node_crossings(split, ranks_per_node: int) -> list[int]:
    """Per axis: k_a, the most ranks of one node whose upper neighbour along a is on another node."""
    p, out = math.prod(split), []
    for a, s in enumerate(split):
        stride = math.prod(split[a + 1:])
        per_node = Counter(r // ranks_per_node for r in range(p)
                           if (r // stride) % s < s - 1 and r // ranks_per_node != (r + stride) // ranks_per_node)
        out.append(max(per_node.values(), default=0))
    return out


# ----------------------------------------------------------------------------- communication
def halo_traffic(net: Net, block, split) -> dict:
    """Per step for the most connected rank (f_a = min(split_a - 1, 2) neighbours along axis a):
    bytes sent = 2 * sum_layers sum_a f_a * B_{l,a}, messages = 2 * layers * sum_a f_a."""
    faces = [min(s - 1, 2) for s in split]
    layers = halo_layers(net)
    nbytes = 2 * sum(f * face_nodes([n >> lv for n in block], a) * c * FP32
                     for lv, c in layers for a, f in enumerate(faces))
    return dict(halo_bytes=nbytes, halo_messages=2 * len(layers) * sum(faces), halo_layers=len(layers))


def halo_time(net: Net, block, split, links) -> float:
    """t_halo = 2 * sum_layers sum_{a: split_a > 1} 2 * (alpha_a + B_{l,a} / beta_a); links[a] =
    (alpha_a s, beta_a bytes/s)."""
    t = 0.0
    for lv, c in halo_layers(net):
        for a, s in enumerate(split):
            if s > 1:
                alpha, beta = links[a]
                t += 2 * (alpha + face_nodes([n >> lv for n in block], a) * c * FP32 / beta)
    return 2 * t


def axis_links(prof: dict, split, ranks_per_node: int) -> tuple[list, list[str]]:
    """Per axis (alpha, beta) and its name: shm when k_a = 0, else the network at beta / k_a."""
    shm, net = link_params(prof, 1), link_params(prof, 2)
    links, names = [], []
    for k in node_crossings(split, ranks_per_node):
        links.append(shm if k == 0 else (net[0], net[1] / k))
        names.append("shm" if k == 0 else f"net/{k}")
    return links, names


def norm_time(net: Net, p: int, alpha: float, beta: float) -> float:
    """t_norm = 4 * sum_norms allreduce(P, 4 C): the two sums of each norm, forward and backward."""
    return 4 * sum(allreduce_time(p, FP32 * c, alpha, beta)[0] for c in norm_channels(net))


# ----------------------------------------------------------------------------- the step
def domain_step(net: Net, grid, split, ranks_per_node: int, t_rank: float, prof: dict,
                params: int | None = None) -> dict | None:
    """One step of one sample split ``split``; None if invalid or P not a multiple of ranks_per_node."""
    p = math.prod(split)
    if not valid_split(grid, split, net.depth) or p % ranks_per_node:
        return None
    nodes, block = p // ranks_per_node, [g // s for g, s in zip(grid, split)]
    links, names = axis_links(prof, split, ranks_per_node)
    alpha, beta = link_params(prof, nodes)
    params = param_count(net) if params is None else params
    t_grad, algo = allreduce_time(p, FP32 * params, alpha, beta)
    parts = dict(t_compute=t_rank / p, t_halo=halo_time(net, block, split, links),
                 t_norm=norm_time(net, p, alpha, beta), t_grad=t_grad)
    t_step = sum(parts.values())
    return dict(nodes=nodes, ranks=p, split=list(split), block=block, links=names, **parts,
                t_comm=t_step - parts["t_compute"], t_step=t_step, comm_share=1 - parts["t_compute"] / t_step,
                grad_algorithm=algo, norm_allreduces=4 * len(norm_channels(net)),
                **halo_traffic(net, block, split))


def predict_domain(prof: dict, grid, t_sample: float, t_sample_grid, net: Net | None = None,
                   t_ref_threads: int = 1, serial_fraction: float = 0.05, nodes_list=NODES,
                   splits=None, ranks_per_node: int | None = None, threads_per_rank: int | None = None,
                   params: int | None = None) -> list[dict]:
    """Rows for ``nodes_list`` (most cubic split each) or for the given ``splits``; efficiency
    against the first valid auto-split row of ``nodes_list`` (1 node by default)."""
    net = net or Net(dims=len(grid))
    if len(t_sample_grid) != len(grid) or net.dims != len(grid):
        raise ValueError(f"t_sample grid {list(t_sample_grid)}, network dims {net.dims} and "
                         f"domain grid {list(grid)} must have the same number of axes")
    r = ranks_per_node or prof["ranks_per_node"]
    t = threads_per_rank or prof["threads_per_rank"]
    t_rank = amdahl(t_sample * math.prod(grid) / math.prod(t_sample_grid), t_ref_threads, t, serial_fraction)

    def step(split):
        return domain_step(net, grid, split, r, t_rank, prof, params) if split else None

    auto = [row for row in (step(choose_split(grid, n * r, net.depth)) for n in nodes_list) if row]
    rows = auto if splits is None else [row for row in map(step, splits) if row]
    base = auto[0] if auto else (rows[0] if rows else None)
    for row in rows:
        row.update(ranks_per_node=r, threads_per_rank=t, t_sample_rank=t_rank,
                   speedup=base["t_step"] / row["t_step"],
                   efficiency=base["t_step"] * base["nodes"] / (row["nodes"] * row["t_step"]))
    return rows


# ----------------------------------------------------------------------------- CLI
def add_arguments(p) -> None:
    """The domain-mode flags of ``deepfusion jobs model``."""
    g = p.add_argument_group("domain parallelism (one sample split over the ranks)")
    g.add_argument("--domain-grid", help="model ONE sample of this grid split over all ranks, e.g. 4096x4096")
    g.add_argument("--t-sample-grid", help="grid on which --t-sample (or --sweep) was measured, e.g. 2048x2048")
    g.add_argument("--domain-split", help="comma-separated splits to model instead of the most cubic "
                                          "one per node count, e.g. 32x32,16x16")
    g.add_argument("--depth", type=int, default=4, help="U-Net depth (default 4)")
    g.add_argument("--base-width", type=int, default=16, help="U-Net level-0 channels (default 16)")
    g.add_argument("--max-width", type=int, default=128, help="U-Net channel cap (default 128)")
    g.add_argument("--in-channels", type=int, default=1, help="input fields of the network (default 1)")


def format_table(results: dict) -> str:
    out = ["| cluster | nodes | ranks | split | block | links | T_step s | compute s | halo ms | norm ms "
           "| grad ms | efficiency |", "|---|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, rows in results.items():
        for r in rows:
            out.append(f"| {name} | {r['nodes']} | {r['ranks']} | {'x'.join(map(str, r['split']))} | "
                       f"{'x'.join(map(str, r['block']))} | {','.join(r['links']) or '-'} | {r['t_step']:.4f} | "
                       f"{r['t_compute']:.4f} | {1e3 * r['t_halo']:.2f} | {1e3 * r['t_norm']:.2f} | "
                       f"{1e3 * r['t_grad']:.2f} | {r['efficiency']:.3f} |")
    return "\n".join(out)


def run(args, t_sample: float, t_ref: int, s: float) -> int:
    """``deepfusion jobs model --domain-grid ...``: domain.json, domain.png and the table."""
    try:
        if not args.t_sample_grid:
            raise ValueError("--domain-grid needs --t-sample-grid (the grid --t-sample was measured on)")
        grid, ref = parse_grid(args.domain_grid), parse_grid(args.t_sample_grid)
        splits = [parse_grid(v) for v in args.domain_split.split(",")] if args.domain_split else None
        net = Net(len(grid), args.depth, args.base_width, args.max_width, args.in_channels)
        if net.depth < 0 or min(net.base_width, net.in_channels) < 1 or net.max_width < net.base_width:
            raise ValueError(f"network {asdict(net)}: needs depth >= 0, widths and channels >= 1, "
                             "max_width >= base_width")
        for split in splits or []:
            if len(split) != len(grid) or not valid_split(grid, split, net.depth):
                raise ValueError(f"split {'x'.join(map(str, split))} does not cut {args.domain_grid} into "
                                 f"equal blocks with sides multiples of 2**depth = {2**net.depth}")
        profiles = load_profiles(args.profiles)
        names = [c.strip() for c in args.clusters.split(",") if c.strip()]
        results = {n: predict_domain(get_profile(n, profiles), grid, t_sample, ref, net, t_ref, s,
                                     splits=splits, ranks_per_node=args.ranks_per_node,
                                     threads_per_rank=args.threads_per_rank, params=args.params)
                   for n in names}
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    params = param_count(net) if args.params is None else args.params
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    inputs = dict(grid=list(grid), t_sample=t_sample, t_sample_grid=list(ref), t_ref_threads=t_ref,
                  serial_fraction=s, network=asdict(net), widths=net.widths, params=params,
                  gradient_bytes=FP32 * params, halo_layers=len(halo_layers(net)),
                  norm_layers=len(norm_channels(net)), splits=[list(v) for v in splits] if splits else None)
    (out / "domain.json").write_text(json.dumps(dict(inputs=inputs, predictions=results), indent=2))
    plot_efficiency(results, out / "domain.png",
                    f"one {args.domain_grid} sample split; t_sample={t_sample:.3g}s @{args.t_sample_grid}, "
                    f"{t_ref} thr, s={s:.2f}, {params / 1e6:.2f}M params")
    print(format_table(results))
    for name in (n for n, rows in results.items() if not rows):
        print(f"note: {name}: no layout fits (blocks must be multiples of 2**depth = {2**net.depth} "
              f"and the split's ranks a multiple of ranks_per_node)")
    print(f"\nwrote {out / 'domain.json'} and {out / 'domain.png'}")
    return 0
