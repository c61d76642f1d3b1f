"""What a grown network's answer costs on its finest grid, per correction-network option set.

    python -m lab.tools.correction_cost CONFIG [--correction '{base_width = 4}' ...]
                                    [--batch 1] [--repeats 3] [--threads 2] [--out FILE.json]

The network is the one CONFIG's schedule ends with (built and grown level by level as
``deepfusion train`` does, random weights: the cost does not depend on them). Each
``--correction`` (a TOML inline table, as the config writes it) replaces the last level's
correction options (its ``correction`` table; none given: the config's own). Per option set:
the median seconds of one forward pass at ``--batch`` samples on ``problem.grid`` (no
gradients, channels-last as configured), the same for the network inside it on its own grid,
and the correction's parameter count. The problem's combination (e.g. Ritz) is not included:
``lab.tools.ritz_partition`` and ``bench.infer_bench`` time it on a trained checkpoint. One
process, ``--threads`` threads.
"""
from __future__ import annotations

import argparse
import json
import sys

from bench.common import emit_json, machine, median_seconds


def _seconds(net, x, repeats: int) -> float:
    import torch

    with torch.inference_mode():
        return median_seconds(lambda: net(x), repeats)


def grown_network(cfg):
    """CONFIG's final network: built, then grown at every visit that grows it."""
    from deepfusion.app.build import build_model, build_problem, model_grower
    from deepfusion.engine.train.plan import plan

    task = build_problem(cfg)
    model = build_model(cfg, task)[0]
    grow = model_grower(cfg, task)
    for v in plan(cfg):
        if v.grows:
            model = grow(model, v)[0]
    return model.eval(), task


def run(config: str, corrections, batch: int, repeats: int) -> list[dict]:
    import torch

    from deepfusion.app.build import torch_dtype
    from deepfusion.config import load_config
    from diffnet.resample import resample_nodes

    rows, last = [], len(load_config(config).train.levels) - 1
    for corr in corrections:
        sets = [] if corr is None else [f"train.levels[{last}].correction={corr}"]
        cfg = load_config(config, sets)
        net, task = grown_network(cfg)
        if not hasattr(net, "correction"):
            raise SystemExit(f"{config}: its last level does not grow the network (prolong)")
        fmt = torch.channels_last if cfg.model.channels_last else torch.contiguous_format
        x = torch.randn((batch, len(task.input_channels), *cfg.problem.grid),
                        dtype=torch_dtype(cfg)).contiguous(memory_format=fmt)
        inner_x = resample_nodes(x, net.inner_grid).contiguous(memory_format=fmt)
        rows.append({"correction": net.correction_kwargs, "grid": list(net.grid),
                     "forward_s": _seconds(net, x, repeats) / batch,
                     "inner_forward_s": _seconds(net.inner, inner_x, repeats) / batch,
                     "inner_grid": list(net.inner_grid),
                     "correction_parameters": sum(p.numel() for p in
                                                  net.correction.parameters())})
        r = rows[-1]
        print(f"{json.dumps(r['correction'])}: forward {r['forward_s']:.3f} s per sample "
              f"(the network inside, on {r['inner_grid']}: {r['inner_forward_s']:.3f} s), "
              f"{r['correction_parameters']} correction parameters", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", help="a config whose last level grows the network (prolong)")
    ap.add_argument("--correction", action="append", default=None,
                    help="options of the last level's correction network as a TOML inline "
                         "table, e.g. '{base_width = 4, max_width = 16}' (repeatable)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/out/correction_cost.json")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from deepfusion.config import ConfigError

    try:
        rows = run(args.config, args.correction or [None], args.batch, args.repeats)
    except ConfigError as e:  # a bad --correction names the key and what it should be
        raise SystemExit(f"lab.tools.correction_cost: {e}") from None
    emit_json({"machine": machine(), "threads": args.threads, "config": args.config,
               "batch": args.batch, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
