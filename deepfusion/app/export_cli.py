"""``deepfusion export CHECKPOINT --format torchscript|onnx --out FILE``: the trained solver as one
file that runs without DeepFusion (the work: :mod:`.export`).

One process, no MPI. Exit codes as every local command (:mod:`.policy`): 0 written, 2 refused
(bad input, an answer head the format cannot hold, a file that differs from the eager answer,
a missing ONNX package); nothing is written unless the file passed its check.
"""
from __future__ import annotations

import os
import sys

from deepfusion.app.options import ANSWER_SET_HELP, add_set, problem_options
from deepfusion.app.policy import run_local


def register(sub) -> None:
    p = sub.add_parser(
        "export", help="write a trained solver as a TorchScript or ONNX file (input fields -> "
                       "answer, boundary values and answer head included) that runs without "
                       "deepfusion")
    p.add_argument("checkpoint", help="a checkpoint file (run_dir/checkpoints/step_*.h5), or a "
                                      "run directory (its newest complete one)")
    p.add_argument("--format", required=True, choices=("torchscript", "onnx"),
                   help="torchscript: a TorchScript archive for torch.jit.load (Python) or "
                        "torch::jit::load (LibTorch, C++); onnx: an ONNX model for onnxruntime "
                        "(needs the packages onnx, onnxruntime and onnxscript: pip install -e "
                        "'.[onnx]')")
    p.add_argument("--out", required=True, metavar="FILE",
                   help="the file to write (e.g. model.pt, model.onnx); its directory must exist")
    p.add_argument("--grid", metavar="HxW|DxHxW",
                   help="the grid of the input fields and the answer (default: the training "
                        "grid); the batch size N stays free")
    p.add_argument("--work-grid", metavar="HxW|DxHxW|trained|as-is",
                   help="the grid the network runs on inside the file: the inputs are "
                        "resampled to it and the answer back to --grid (default 'trained': the "
                        "training grid; 'as-is': the network runs on --grid itself)")
    p.add_argument("--dtype", choices=("float32", "float64"),
                   help="the dtype of the inputs, weights and answer (default: the "
                        "checkpoint's; onnxruntime runs float32 convolutions only)")
    add_set(p, ANSWER_SET_HELP)
    p.set_defaults(run=lambda args: run_local(cmd_export, args))


def cmd_export(args) -> int:
    from deepfusion.app.export import export
    from deepfusion.app.inference import grid_text, parse_grid

    notes: list = []
    try:
        done = export(args.checkpoint, args.format, args.out, grid=parse_grid(args.grid),
                      work_grid=args.work_grid, options=problem_options(args, "export"),
                      dtype=args.dtype, notes=notes)
    finally:
        for level, text in notes:
            print(f"deepfusion: {level}: {text}", file=sys.stderr, flush=True)
    shape = ", ".join(str(v) for v in done["input_shape"])
    print(f"export: {done['problem']} {grid_text(done['grid'])} ({done['export_format']}, "
          f"{done['dtype']}): {done['input_name']} ({shape}) {done['input_channels']} -> "
          f"{done['output_name']} (N, 1, {grid_text(done['grid']).replace('x', ', ')}); "
          f"checked on other draws at batch 1 and 3: max relative difference "
          f"{done['max_rel_diff']:.2g} -> {os.path.abspath(args.out)} "
          f"({done['bytes'] / 2**20:.2f} MiB)", flush=True)
    return 0
