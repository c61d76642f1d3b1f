"""``deepfusion compare``: a prediction file against a reference file (same problem, grid and
samples): per-sample relative L2 and max errors, a summary with timings and speed-up
(``compare.json``), a text table and a figure (``compare.png``: 2-D fields whole, 3-D fields as
three orthogonal mid-slices).

Before any number is computed the two files are checked to be what their places say (the first
one written by ``infer``, the second by ``solve``: their ``kind`` attribute) and to hold the same
draws (problem, grid, coordinates, parameter vectors or input fields): a swapped pair or two of a
kind would report a meaningless error and speed-up, so they are refused naming the fix.

Files: see :mod:`deepfusion.app.fields_file`. One process; kept light on imports (the command
line is built from every command's ``register``).
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

from deepfusion.app.outputs import check_output, check_output_dir
from deepfusion.app.policy import ExitCode

WRITER = {"prediction": "deepfusion infer", "reference": "deepfusion solve"}


def register(sub) -> None:
    """Add the compare subcommand to the ``deepfusion`` parser."""
    c = sub.add_parser("compare", help="errors and timings of predictions against references")
    c.add_argument("preds", help="file written by 'deepfusion infer'")
    c.add_argument("ref", help="file written by 'deepfusion solve'")
    c.add_argument("--out", metavar="DIR", help="directory for compare.json and compare.png "
                                                "(default: the directory of PREDS)")
    c.add_argument("--figures", type=int, default=3, help="samples shown (plus the worst)")
    c.set_defaults(run=run_compare)


def run_compare(args) -> int:
    try:
        out_dir = args.out or os.path.dirname(os.path.abspath(args.preds))
        summary, table = compare_files(args.preds, args.ref, out_dir, n_figures=args.figures)
    except (ValueError, OSError, KeyError) as e:
        print(f"deepfusion: error: {e}", file=sys.stderr, flush=True)
        return ExitCode.INPUT
    print(table, flush=True)
    return 0


def _check_kinds(a: dict, b: dict, pa, pb) -> None:
    """Raise ValueError unless ``pa`` is a prediction and ``pb`` a reference (their ``kind``
    attributes), naming the fix: the swapped order, or the file still to be made."""
    ka, kb = a["kind"], b["kind"]
    for path, kind in ((pa, ka), (pb, kb)):
        if kind not in WRITER:
            raise ValueError(f"{path} records no kind (root attribute 'kind' is {kind!r}, not "
                             f"'prediction' or 'reference'): compare takes a file written by "
                             f"'deepfusion infer' and one written by 'deepfusion solve'")
    if (ka, kb) == ("prediction", "reference"):
        return
    if (ka, kb) == ("reference", "prediction"):
        raise ValueError(f"the files are swapped: {pa} is a reference (written by 'deepfusion "
                         f"solve') and {pb} a prediction ('deepfusion infer'); give the "
                         f"prediction first: deepfusion compare {pb} {pa}")
    other = "reference" if ka == "prediction" else "prediction"
    raise ValueError(f"{pa} and {pb} are both {ka}s (written by '{WRITER[ka]}'); compare "
                     f"takes a prediction and a reference of the same draws: make the "
                     f"{other} with '{WRITER[other]}' on the same inputs "
                     f"({_draw_flags(a.get('inputs_from'))}) and run "
                     f"deepfusion compare PREDICTION.h5 REFERENCE.h5")


def _draw_flags(note) -> str:
    """The flags that reproduce a file's draws from its ``inputs_from`` attribute
    ("sample:N seed:S", "params:PATH" or "inputs:PATH")."""
    kind, _, rest = str(note or "").partition(":")
    if kind == "sample":
        n, _, seed = rest.partition(" seed:")
        return f"--samples {n} --seed {seed}"
    if kind in ("params", "inputs"):
        return f"--{kind} {rest}"
    return "the same --samples N --seed S, --params or --inputs"


def _check_same(a: dict, b: dict, pa, pb) -> None:
    """Raise ValueError naming the first difference of problem, grid or samples."""
    def differ(what, va, vb):
        raise ValueError(f"{pa} and {pb} describe different {what}: {va} vs {vb}")
    if a["problem"] != b["problem"]:
        differ("problems", a["problem"], b["problem"])
    if a["axes"] != b["axes"]:
        differ("axes", a["axes"], b["axes"])
    if a["u"].shape != b["u"].shape:
        differ("samples or grids (shape of /u, (N, *grid))", a["u"].shape, b["u"].shape)
    for ax in a["axes"]:
        ca, cb = a["coords"].get(ax), b["coords"].get(ax)
        if ca is None or cb is None or ca.shape != cb.shape or not np.allclose(ca, cb):
            differ(f"coordinates along {ax} (domain or grid)", ca, cb)
    if a["params"].shape != b["params"].shape:
        differ("parameter sets (shape of /params)", a["params"].shape, b["params"].shape)
    if a["params"].size and not np.array_equal(a["params"], b["params"]):
        j = int(np.argmax(np.any(a["params"] != b["params"], axis=1)))
        differ("samples (params differ; use the same --samples N --seed S, --params or "
               f"--inputs for both; first at sample {j})", a["params"][j].tolist(),
               b["params"][j].tolist())
    if not a["params"].size and a["inputs"] is not None and b["inputs"] is not None:
        c = min(a["inputs"].shape[1], b["inputs"].shape[1], 1)
        if not np.allclose(a["inputs"][:, :c], b["inputs"][:, :c], rtol=1e-5, atol=1e-7):
            differ("samples (the first input channels differ)", "", "")


def check_out(out_dir: str, inputs) -> None:
    """ValueError unless ``out_dir`` is an existing, writable directory outside any run's
    checkpoints, whose compare.json and compare.png are not the files compared."""
    check_output_dir(out_dir, flag="--out")
    for name in ("compare.json", "compare.png"):
        check_output(os.path.join(out_dir, name), flag="--out", inputs=inputs)


def compare_files(pred_path, ref_path, out_dir, n_figures: int = 3) -> tuple[dict, str]:
    """Per-sample errors, summary and timings; writes out_dir/compare.json and compare.png."""
    from diffnet.metrics import max_error, relative_l2

    from deepfusion.app.fields_file import read_fields

    check_out(out_dir, (pred_path, ref_path))
    a, b = read_fields(pred_path), read_fields(ref_path)
    if a["has_reference"] is not None and not a["has_reference"]:
        raise ValueError(f"{pred_path}: problem {a['problem']!r} has no reference solver (it "
                         f"does not define reference_solution), so there is no reference to compare "
                         f"with; 'deepfusion evaluate RUN_DIR' reports the loss and its terms "
                         f"on test draws instead")
    _check_kinds(a, b, pred_path, ref_path)
    _check_same(a, b, pred_path, ref_path)
    dims = a["u"].ndim - 1  # /u is (N, *grid): one row per sample
    rel = relative_l2(a["u"], b["u"], dims=dims)
    mx = max_error(a["u"], b["u"], dims=dims)
    worst = int(rel.argmax())
    t_inf, t_ref = a["seconds_per_sample"], b["seconds_per_sample"]
    if t_inf and a["refine_seconds"] is not None:   # a refined answer costs its refinement too
        t_inf += float(np.mean(a["refine_seconds"]))
    summary = {
        "preds": os.path.abspath(pred_path), "ref": os.path.abspath(ref_path),
        "problem": a["problem"], "grid": list(a["u"].shape[1:]), "n": len(rel),
        "pred_source": a["source"], "ref_source": b["source"],
        # where the network ran: the file's grid (native) or a coarser work grid + interpolation
        "pred_work_grid": a["work_grid"],
        "rel_l2_mean": float(rel.mean()), "rel_l2_median": float(np.median(rel)),
        "rel_l2_worst": float(rel[worst]), "worst_index": worst,
        "max_err_mean": float(mx.mean()), "max_err_worst": float(mx.max()),
        "seconds_per_sample_inference": t_inf, "seconds_per_sample_solver": t_ref,
        "refined": a["refine_seconds"] is not None,
        "speedup": (t_ref / t_inf) if t_inf and t_ref else None,
        "problem_kwargs_differ": sorted(k for k in set(a["problem_kwargs"]) | set(b["problem_kwargs"])
                                        if a["problem_kwargs"].get(k) != b["problem_kwargs"].get(k)),
        "rel_l2": rel.tolist(), "max_err": mx.tolist()}
    shown = sorted(set(range(min(n_figures, len(rel)))) | {worst})
    summary["figure"] = _figure(a, b, shown, rel, os.path.join(out_dir, "compare.png"))
    path = os.path.join(out_dir, "compare.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    return summary, _table(summary, path)


def _table(s: dict, path: str) -> str:
    rows = [f"{'sample':>8} {'rel_L2':>11} {'max_err':>11}"]
    n = s["n"]
    show = list(range(n)) if n <= 20 else sorted(set(range(10)) | {s["worst_index"]})
    for j in show:
        mark = "  <- worst" if j == s["worst_index"] else ""
        rows.append(f"{j:>8d} {s['rel_l2'][j]:>11.4e} {s['max_err'][j]:>11.4e}{mark}")
    if n > len(show):
        rows.append(f"{'...':>8} ({n - len(show)} more in {path})")
    sp = f"{s['speedup']:.3g}x" if s["speedup"] else "n/a"
    rows += [f"relative L2 over {n} samples: mean {s['rel_l2_mean']:.4e}  median "
             f"{s['rel_l2_median']:.4e}  worst {s['rel_l2_worst']:.4e} (sample "
             f"{s['worst_index']});  max error worst {s['max_err_worst']:.4e}",
             f"seconds per sample: inference{' + refinement' if s['refined'] else ''} "
             f"{s['seconds_per_sample_inference']:.4g}  solver "
             f"{s['seconds_per_sample_solver']:.4g}  (speedup {sp})",
             _work_grid_line(s),
             f"-> {path}, {s['figure']}"]
    if s["problem_kwargs_differ"]:
        rows.append(f"note: the two files' problem options differ in {s['problem_kwargs_differ']} "
                    f"(same samples and grid; check this is intended)")
    return "\n".join(rows)


def _work_grid_line(s: dict) -> str:
    """Which grid each side ran on, so a speed-up is read like for like."""
    grid, wg = "x".join(map(str, s["grid"])), s["pred_work_grid"]
    if not wg:
        return f"grids: the file's grid is {grid} (the prediction file does not record its work grid)"
    if list(wg) == list(s["grid"]):
        return f"grids: network and solver both on {grid} (native)"
    return (f"grids: the network ran on a {'x'.join(map(str, wg))} work grid, interpolated to "
            f"{grid}; the solver on {grid}. This is a coarse model plus interpolation: compare "
            f"it with a coarse solve plus interpolation too")


def _figure(a: dict, b: dict, shown, rel, path: str) -> str:
    """compare.png: per shown sample input channel 0, prediction, reference, error (a 3-D
    grid: three rows, its orthogonal mid-slices)."""
    from deepfusion.engine.predict.plots import fields_figure, views

    names = list(a["axes"])
    coords = [a["coords"][ax] for ax in names]
    ch = a["channels"][0] if a["channels"] else "input"
    worst = int(rel.argmax())
    rows = []
    for j in shown:
        pred, ref = a["u"][j], b["u"][j]
        x = a["inputs"][j, 0] if a["inputs"] is not None else ref
        rows.append({"input": views(x), "pred": views(pred), "ref": views(ref),
                     "error_title": f"error #{j}, rel L2 {rel[j]:.3g}"
                                    + (" (worst)" if j == worst else "")})
    return fields_figure(path, rows, names=names, bounds=[(c[0], c[-1]) for c in coords],
                         grid=a["u"].shape[1:], titles=(f"input {ch}", "prediction", "reference"),
                         dpi=80)
