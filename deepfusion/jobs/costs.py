"""The cost terms the scaling models of ``deepfusion jobs`` share (:mod:`.model`, data
parallelism; :mod:`.domain_model`, one sample split over the ranks; :mod:`.project` and
:mod:`.project_recipe`, time to accuracy): the alpha-beta all-reduce (ring, recursive doubling,
the faster of the two), the link of a node count (a profile's shm_* inside one node, link_*
across nodes), the wait for the gradient all-reduce with and without overlap, Amdahl's law over
a rank's threads, the node counts modelled, and the efficiency-against-nodes figure.
"""
from __future__ import annotations

import math
import os

NODES = [1, 2, 4, 8, 16, 32, 64, 128]


def allreduce_ring(p: int, nbytes: float, alpha: float, beta: float) -> float:
    """Ring allreduce (reduce-scatter + allgather); alpha in s, beta in bytes/s."""
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes / beta


def allreduce_recursive_doubling(p: int, nbytes: float, alpha: float, beta: float) -> float:
    """Recursive doubling: ceil(log2 P) rounds, each sends the whole vector."""
    if p <= 1:
        return 0.0
    return math.ceil(math.log2(p)) * (alpha + nbytes / beta)


def allreduce_time(p: int, nbytes: float, alpha: float, beta: float) -> tuple[float, str]:
    """(seconds, algorithm): the faster of ring and recursive doubling."""
    if p <= 1:
        return 0.0, "none"
    ring = allreduce_ring(p, nbytes, alpha, beta)
    rd = allreduce_recursive_doubling(p, nbytes, alpha, beta)
    return (ring, "ring") if ring <= rd else (rd, "recursive_doubling")


# The backward pass costs about twice the forward (two products per weight instead of one).
BACKWARD_SHARE = 2.0 / 3.0


def gradient_wait(t_allreduce: float, t_compute: float, overlap: bool,
                  hidden_share: float = BACKWARD_SHARE) -> float:
    """Seconds a step waits for its gradient all-reduce after ``t_compute`` of forward and
    backward: all of it, or with ``parallel.overlap`` (buckets all-reduced as the backward pass
    fills them) only what outlasts ``hidden_share`` of the compute. The default (the backward
    pass) is a bound: it assumes the network moves the messages while every core computes (an
    RDMA interconnect), which a rank on a core of its own does not give (docs/performance.md);
    ``deepfusion.jobs.measured`` measures it instead."""
    if not overlap:
        return t_allreduce
    return max(0.0, t_allreduce - hidden_share * t_compute)


def link_params(prof: dict, nodes: int) -> tuple[float, float]:
    """(alpha seconds, beta bytes/s): shared memory inside one node, the network otherwise."""
    if nodes <= 1:
        return prof["shm_latency_us"] * 1e-6, prof["shm_bandwidth_GBps"] * 1e9
    return prof["link_latency_us"] * 1e-6, prof["link_bandwidth_GBps"] * 1e9


def amdahl(t_sample: float, t_ref_threads: int, threads: int, serial_fraction: float) -> float:
    """Per-sample time of one rank at ``threads`` given it was ``t_sample`` at ``t_ref_threads``."""
    s = serial_fraction
    t1 = t_sample / (s + (1 - s) / t_ref_threads)
    return t1 * (s + (1 - s) / threads)


def plot_efficiency(results: dict, path: str | os.PathLike, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, rows in results.items():
        if rows:
            ax.plot([r["nodes"] for r in rows], [r["efficiency"] for r in rows], marker="o",
                    label=f"{name} ({rows[0]['ranks_per_node']}x{rows[0]['threads_per_rank']}/node)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("nodes")
    ax.set_ylabel("predicted parallel efficiency (strong scaling)")
    ax.set_ylim(0, 1.05)
    ax.grid(True, alpha=0.3)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
