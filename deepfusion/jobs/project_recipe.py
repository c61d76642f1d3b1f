"""Projected time to a recipe's own accuracy on a cluster: the recipe's plan as it is (its
levels' grids, global batches and steps: the run that measured its test error) times the
modelled step time of the best layout for each node count.

    deepfusion jobs project --config configs/recipes/RECIPE.toml --out DIR

The batch is the recipe's, so the error reached is the recipe's measured test error, not a
projection; what more nodes buy is more ranks per step. Data parallelism stops at the global
batch; a split of each sample over ``k`` ranks (``parallel.domain``) carries a level past it
wherever the recipe can split (a split the networks' depths and the problem accept:
``deepfusion check`` decides, once per candidate split). One layout serves the whole
run, as in a real job: P = nodes x r ranks (r ranks per node, T = cores / r threads each) in
G = P / k groups, G dividing every level's batch, and

    t_sample_l(k) = deepfusion.jobs.domain_model.domain_step's compute + halo + norm time of one sample
                    of level l on k ranks (k = 1: amdahl(t_sample_l, T)), plus on a level whose
                    network was grown (prolong) the whole-field gathers around each
                    resampling of its chain (:func:`gather_time`),
    time          = sum over levels of steps_l * e_l * (ceil(B_l / G) * t_sample_l(k)
                                                        + wait(allreduce(P, 4 * params))),

e_l: loss evaluations per step (1; under L-BFGS :func:`evaluations_per_step`),

wait = deepfusion.jobs.costs.gradient_wait: the whole all-reduce, or with ``--overlap`` what outlasts
the share of the compute that hides it (2/3, a bound; or measured, ``deepfusion.jobs.measured``,
which also adds the measured arrival skew to every step).

Measured: t_sample_l, by ``deepfusion check``'s probe on this host (or ``--t-sample``, one per
level); modelled: the rest, as in ``deepfusion.jobs.project``.
"""
from __future__ import annotations

import math
from dataclasses import replace

from deepfusion.app import checks
from deepfusion.engine.errors import InputError
from deepfusion.jobs.costs import allreduce_time, amdahl, link_params
from deepfusion.jobs import project_limits
from deepfusion.jobs.domain_model import Net, choose_split, domain_step, param_count, valid_split
from deepfusion.jobs.profiles import node_layouts


def recipe_levels(config: str, sets: list) -> tuple[object, list[dict]]:
    """(the checked config, [{level, grid, batch, steps, evals, chain, channels}] per visit of
    its plan)."""
    cfg = checks.check_launch(config, sets, 1).cfg
    visits = checks.level_plan(cfg)
    levels = [{"level": v.level, "grid": list(v.grid), "batch": v.global_batch,
               "steps": v.steps, "evals": evaluations_per_step(v.optim)} for v in visits]
    channels = list(checks.problem_channels(cfg, levels[0]["grid"]))
    chains = prolonged_chains(visits)
    for lv in levels:  # [(fine grid, inner grid, inner trains)] of the network on the level's grid
        lv["chain"] = [[list(f), list(c), t] for f, c, t in chains.get(tuple(lv["grid"]), [])]
        lv["channels"] = list(channels)
    return cfg, levels


def evaluations_per_step(optim) -> int:
    """Loss evaluations (each a forward, backward and gradient all-reduce over the batch) per
    step: 1, or under L-BFGS its iterations plus the first: the fewest it can take (every line
    search accepting its first trial, as nearly all did in the batch study). A switch to L-BFGS
    part-way (``switch_to_lbfgs_epoch``) is counted as Adam throughout."""
    return 1 + optim.lbfgs_max_iter if optim.name == "lbfgs" else 1


def prolonged_chains(visits) -> dict:
    """{grid: the resampling stages of the network that answers on it}: a visit that grows
    the network adds (its grid, its inner grid, whether the inner network trains) to the
    stages of the network on the inner grid."""
    chains: dict = {}
    for v in visits:
        if v.inner_grid:
            chains[tuple(v.grid)] = chains.get(tuple(v.inner_grid), []) + [
                (tuple(v.grid), tuple(v.inner_grid), bool(v.train_inner))]
    return chains


def gather_time(lv: dict, split, alpha: float, beta: float) -> float:
    """Seconds per sample of a split prolonged network's collectives (diffnet.split_layers
    .split_prolonged): per stage, the input fields gathered whole on the fine grid and the
    inner answer gathered whole on the inner grid, one line of blocks per axis (ring
    allgathers, each block receiving the whole field; links as ``deepfusion.jobs.costs.link_params``
    for the nodes one sample spans), and in backward, where the inner
    network trains, the inner answer's gradient all-reduced along each line. The resampling
    itself (pointwise work on whole fields) is not modelled."""
    c_in, c_out = lv["channels"]
    k = math.prod(split)
    total = 0.0
    for fine, inner, trains in lv["chain"]:
        for nbytes in (4.0 * c_in * math.prod(fine), 4.0 * c_out * math.prod(inner)):
            total += sum(s - 1 for s in split) * alpha + (1 - 1 / k) * nbytes / beta
        if trains:
            total += sum(allreduce_time(s, 4.0 * c_out * math.prod(inner), alpha, beta)[0]
                         for s in split if s > 1)
    return total


def recipe_net(cfg, dims: int) -> Net:
    """The modelled U-Net of the recipe's model options (the generator's defaults elsewhere)."""
    o = cfg.model.options
    return Net(dims=dims, depth=int(o.get("depth", 4)), base_width=int(o.get("base_width", 16)),
               max_width=int(o.get("max_width", 128)))


def probe_t_samples(cfg, levels: list[dict], threads: int) -> list[float]:
    """Seconds per sample of each visit, from ``deepfusion check``'s probe on one rank."""
    # one loss evaluation per probed step (Adam's): an L-BFGS plan counts its evaluations itself
    one = replace(cfg, parallel=replace(cfg.parallel, domain=[], threads_per_rank=threads),
                  optim=replace(cfg.optim, name="adam", switch_to_lbfgs_epoch=-1))
    measured = {lv["level"]: lv["median_step_s"] / lv["local_batch"]
                for lv in checks.probe(one, 1, threads)["levels"]}
    return [measured[lv["level"]] for lv in levels]


class Splits:
    """Which ``k`` ranks per sample a recipe accepts: a split valid on every level's grid
    (``choose_split`` on the first, then ``valid_split``) that ``deepfusion check`` passes."""

    def __init__(self, config: str, sets: list, levels: list[dict], depth: int):
        self.config, self.sets, self.levels, self.depth = config, list(sets), levels, depth
        self.cache: dict[int, tuple | None] = {1: ()}

    def __call__(self, k: int):
        if k not in self.cache:
            self.cache[k] = self.find(k)
        return self.cache[k]

    def find(self, k: int):
        split = choose_split(self.levels[0]["grid"], k, self.depth)
        if split is None or not all(valid_split(lv["grid"], split, self.depth)
                                    for lv in self.levels):
            return None
        domain = "[" + ", ".join(map(str, split)) + "]"
        try:
            checks.check_launch(self.config, [*self.sets, f"parallel.domain={domain}"], k)
        except (InputError, ValueError):  # train's refusal: the recipe cannot run on this split
            return None
        return split


def level_sample_time(net: Net, lv: dict, split, r: int, t_rank: float, prof: dict):
    """(seconds of one sample of level ``lv`` on the ranks of ``split`` (() = one rank), of them
    exchanges); None if the model has no row for it (the split's ranks do not fill whole
    nodes)."""
    if not split:
        return t_rank, 0.0
    row = domain_step(net, lv["grid"], split, min(r, math.prod(split)), t_rank, prof, params=0)
    if row is None:
        return None
    alpha, beta = link_params(prof, -(-math.prod(split) // r))  # the nodes one sample spans
    gather = gather_time(lv, split, alpha, beta)
    return (row["t_compute"] + row["t_halo"] + row["t_norm"] + gather,
            row["t_halo"] + row["t_norm"] + gather)


def plan_time(prof, nodes, r, threads, k, split, levels, t_samples, args, net):
    """(hours, per-level step seconds, seconds of the run per part of a step) of the recipe on
    one layout (parts: ``deepfusion.jobs.project_limits``); None if it cannot run."""
    p = nodes * r
    groups = p // k
    if any(lv["batch"] % groups for lv in levels):
        return None
    alpha, beta = link_params(prof, nodes)
    t_grad = allreduce_time(p, 4.0 * args.params, alpha, beta)[0]
    steps_s, parts = [], dict.fromkeys(("compute", "halo", "allreduce", "skew"), 0.0)
    for lv, ts in zip(levels, t_samples):
        t_rank = amdahl(ts, args.t_sample_threads, threads, args.serial_fraction)
        per = level_sample_time(net, lv, split, r, t_rank, prof)
        if per is None:
            return None
        compute = (lv["batch"] // groups) * per[0]
        wait = args.allreduce.wait(t_grad, compute, args.overlap)
        skew = args.allreduce.skew(compute)
        steps_s.append(lv["evals"] * (compute + wait + skew))
        halo = (lv["batch"] // groups) * per[1]
        n = lv["steps"] * lv["evals"]
        for key, v in (("compute", compute - halo), ("halo", halo), ("allreduce", wait),
                       ("skew", skew)):
            parts[key] += n * v
    hours = sum(lv["steps"] * s for lv, s in zip(levels, steps_s)) / 3600
    return hours, steps_s, parts


def best_recipe_plan(prof: dict, nodes: int, levels, t_samples, args, net, splits) -> dict | None:
    """The fastest layout of the recipe on ``nodes`` nodes of ``prof``."""
    best = None
    for r, threads in node_layouts(prof):
        p = nodes * r
        for k in (d for d in range(1, p + 1) if p % d == 0):
            split = splits(k)
            if split is None:
                continue
            got = plan_time(prof, nodes, r, threads, k, split, levels, t_samples, args, net)
            if got is None:
                continue
            row = dict(nodes=nodes, batch="/".join(str(lv["batch"]) for lv in levels),
                       rule="recipe", steps=sum(lv["steps"] for lv in levels),
                       ranks_per_node=r, threads_per_rank=threads, ranks=p,
                       domain=list(split) or None, t_step=max(got[1]), hours=got[0],
                       parts=project_limits.shares(got[2]))
            if best is None or row["hours"] < best["hours"]:
                best = row
    return best
