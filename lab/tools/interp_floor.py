"""What interpolation keeps: a coarse field file, interpolated to a fine one's grid, against it.

    deepfusion solve --problem P [--set problem.options.KEY=VALUE ...] --grid 512x512 \
        --samples 64 --seed 271828 --out c.h5
    deepfusion solve --problem P [--set problem.options.KEY=VALUE ...] --grid 1024x1024 \
        --samples 64 --seed 271828 --out f.h5
    python -m lab.tools.interp_floor c.h5 f.h5 [--out FILE.json]

Both files are ``deepfusion solve`` or ``deepfusion infer`` outputs for the same problem and the
same samples (the same ``--samples N --seed S``, checked through ``/params``) on two grids over the
same domain. Each coarse field is interpolated to the fine grid (``diffnet.resample.resample_nodes``:
bilinear / trilinear on nodes, as ``deepfusion infer --work-grid`` transfers resolution) and
compared with the fine field: relative L2 over the fine nodes, per sample, and mean / median /
worst. With two references this is where an exact coarse answer starts: a model trained on the
coarse grid, or a multigrid level that starts from the coarse answer interpolated (``prolong``),
begins about this far from the fine solution. It is a reference, not a strict bound: the exact
nodal values are not the coarse field whose interpolant is closest in L2 (a shock node halfway
between the two states is closer on average), and a 512² Burgers network interpolated to 1024²
has measured 4% under it (lab/notes/readme-second-release.md, "Goal 1").
(``lab.tools.darcy_resolution`` does the same for the Darcy families, solving both grids itself.)

Prints one summary line; writes JSON (files, grids, per-sample errors) to ``--out`` (default
bench/out/interp_floor.json).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from bench.common import ROOT, command_line, emit_json


def floor(coarse_path: str, fine_path: str) -> dict:
    """Relative L2 of the coarse file's fields, interpolated, against the fine file's."""
    import torch

    from deepfusion.app.fields_file import read_fields
    from diffnet.metrics import relative_l2
    from diffnet.resample import resample_nodes

    c, f = read_fields(coarse_path), read_fields(fine_path)
    same = (c["problem"] == f["problem"] and c["params"].shape == f["params"].shape
            and np.array_equal(c["params"], f["params"]))      # /params has a row per sample
    if not same or not c["params"].size:
        raise ValueError(f"{coarse_path} and {fine_path} must hold the same problem and samples "
                         "(make both with the same --problem, --samples N and --seed S)")
    fine_grid = tuple(f["u"].shape[1:])
    if len(c["u"].shape[1:]) != len(fine_grid):
        raise ValueError(f"grids {c['u'].shape[1:]} and {fine_grid} differ in dimension")
    up = resample_nodes(torch.from_numpy(np.asarray(c["u"], np.float64))[:, None], fine_grid)
    rel = relative_l2(up[:, 0].numpy(), np.asarray(f["u"], np.float64), dims=len(fine_grid))
    return {"coarse": os.path.abspath(coarse_path), "fine": os.path.abspath(fine_path),
            "problem": f["problem"], "coarse_grid": list(c["u"].shape[1:]),
            "fine_grid": list(fine_grid), "n": len(rel),
            "rel_l2_mean": float(rel.mean()), "rel_l2_median": float(np.median(rel)),
            "rel_l2_worst": float(rel.max()), "rel_l2": rel.tolist()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.tools.interp_floor",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("coarse", help="field file on the coarse grid (deepfusion solve / infer)")
    ap.add_argument("fine", help="field file on the fine grid, the same samples")
    ap.add_argument("--out", help="JSON path (default bench/out/interp_floor.json)")
    args = ap.parse_args(argv)
    try:
        res = floor(args.coarse, args.fine)
    except (OSError, ValueError) as e:
        print(f"interp_floor: {e}", file=sys.stderr)
        return 2
    g = lambda k: "x".join(map(str, res[k]))  # noqa: E731
    print(f"{res['problem']} {g('coarse_grid')} interpolated to {g('fine_grid')}, {res['n']} "
          f"samples: relative L2 mean {res['rel_l2_mean']:.3%}, median "
          f"{res['rel_l2_median']:.3%}, worst {res['rel_l2_worst']:.3%}")
    res["command"] = command_line(ap.prog, argv)
    emit_json(res, args.out or os.path.join(ROOT, "bench", "out", "interp_floor.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
