"""``deepfusion export CHECKPOINT --format torchscript|onnx --out FILE``: a trained generator and
its problem's answer head as one self-contained file, TorchScript or ONNX, that maps input
fields (N, C, *grid) to the answer (N, 1, *grid) and runs without DeepFusion.

What goes into the file is the prediction service's per-batch computation without ranks
(:func:`deepfusion.engine.predict.service.answer_module`: :class:`diffnet.answer.Answer`, the
network, then the problem's boundary imposition and answer head, with the resampling of
``--work-grid`` around it), in the default (NCHW) layout: the channels-last path of the U-Net's
norm is a Python autograd function, which neither format can hold. A network trained
channels-last (as ``infer`` runs it) answers in NCHW with float32 rounding differences only.

Both formats are made by following one forward pass, so a Python branch on a value is fixed to
the example's outcome. The file is therefore read back and run on other draws, at batch sizes
other than the example's, and compared with the eager answer (same layout, the checkpoint's
dtype) before anything is written: a difference above :data:`TOLERANCE` (relative L2, worst
sample) is refused, as is an answer head the exporter cannot follow (the reason is its own
message, with the line of code it stopped at).

The file carries a description of what it expects (:func:`describe`): as the extra file
``deepfusion.json`` of the TorchScript archive, and as ``metadata_props`` of the ONNX model.

One process, no MPI. Exit codes as every local command (:mod:`.policy`): 0 written, 2 refused
(bad input, an answer head the format cannot hold, a file that differs from the eager answer,
a missing ONNX package); nothing is written unless the file passed its check. Kept light on
imports: torch comes in when the command runs.
"""
from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import re
import sys
import warnings

from deepfusion.app.options import ANSWER_SET_HELP, add_set, problem_options
from deepfusion.app.outputs import check_output, checkpoint_paths
from deepfusion.app.policy import run_local
from deepfusion.version import __version__

FORMATS = ("torchscript", "onnx")
DTYPES = ("float32", "float64")
TOLERANCE = 1e-5
META_NAME = "deepfusion.json"
INPUT_NAME, OUTPUT_NAME = "inputs", "u"
ONNX_PACKAGES = ("onnx", "onnxruntime", "onnxscript")
ONNX_PIP = "pip install onnx onnxruntime onnxscript (from a source tree: pip install -e '.[onnx]')"
# The example the exporter follows, and the other draws the file is checked on: other seeds and
# other batch sizes, so a batch size or a value fixed by the trace shows up as a difference.
EXAMPLE = (101, 2)
CHECKS = ((202, 1), (303, 3))

# the source tree, for naming a file of the package in a message by its path in the tree
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def register(sub) -> None:
    """Add the export subcommand to the ``deepfusion`` parser."""
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
    from deepfusion.engine.predict.loader import grid_text, parse_grid

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


def check_request(fmt: str, out: str, dtype: str | None, inputs=(), run_dirs=()) -> None:
    """ValueError for a format, dtype or output path that cannot work, before any model is
    loaded (loading and tracing a large network takes a while); ``out`` is never one of
    ``inputs`` nor a file of a run (:func:`deepfusion.app.outputs.check_output`)."""
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    check_output(out, flag="--out", inputs=inputs, run_dirs=run_dirs)
    if fmt == "onnx":
        check_onnx()


def check_onnx() -> None:
    """ValueError naming the pip command when a package of the ONNX export is missing."""
    missing = []
    try:
        import onnx  # noqa: F401
    except ImportError:
        missing.append("onnx")
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        missing.append("onnxruntime")
    try:
        import onnxscript  # noqa: F401
    except ImportError:
        missing.append("onnxscript")
    if missing:
        raise ValueError(f"--format onnx needs the packages {', '.join(ONNX_PACKAGES)} "
                         f"(missing: {', '.join(missing)}): {ONNX_PIP}")


def draws(problem, seed: int, n: int, dtype):
    """(n, C, *grid) input fields of ``n`` parameter draws of ``problem`` (seed ``seed``)."""
    return problem.build_input(problem.sample_params(seed, range(n))).to(dtype)


def describe(problem, work, meta, ckpt: str, fmt: str, dtype: str) -> dict:
    """What the file expects and where it comes from (stored in the file)."""
    from deepfusion.engine.predict.loader import training_grid

    c, grid = len(problem.input_channels), list(problem.grid)
    return {"format": "deepfusion-export", "format_version": 1, "export_format": fmt,
            "deepfusion_version": __version__,
            "problem": problem.name, "problem_kwargs": problem.config(),
            "input_name": INPUT_NAME, "input_channels": list(problem.input_channels),
            "input_shape": ["N", c, *grid], "output_name": OUTPUT_NAME,
            "output_shape": ["N", 1, *grid], "dtype": dtype, "grid": grid,
            "axes": [a.name for a in problem.axes],
            "work_grid": list((work or problem).grid), "trained_grid": training_grid(meta),
            "checkpoint": os.path.abspath(ckpt),
            "step": int(meta.get("step", -1))}


def fixed_branches(caught) -> list[str]:
    """'file:line' of each Python branch on a tensor value that the trace fixed, outside torch
    (the tracer's warnings), in order and once each."""
    import torch

    here = os.path.dirname(torch.__file__)
    seen = []
    for w in caught:
        if issubclass(w.category, torch.jit.TracerWarning) and "boolean" in str(w.message) \
                and not w.filename.startswith(here):
            where = f"{source_path(w.filename)}:{w.lineno}"
            if where not in seen:
                seen.append(where)
    return seen


def torchscript_file(module, example, info: dict, label: str = "the answer"):
    """(the TorchScript archive's bytes, run(x) of the archive read back, fixed branches).

    Traced with one thread: code that picks a path by the thread count (the Ritz head's Gram
    products) then takes the path that holds for every batch size. Frozen (weights folded in)
    for inference; ``torch.jit.optimize_for_inference`` is not applied: its oneDNN weight
    packing would tie the file to a LibTorch built with oneDNN."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            traced = torch.jit.freeze(torch.jit.trace(module, example, check_trace=False))
    except Exception as e:  # noqa: BLE001 - whatever the tracer cannot follow is a refusal
        raise ValueError(f"{label} cannot be traced to TorchScript: {type(e).__name__}: "
                         f"{first_line(e)}") from None
    finally:
        torch.set_num_threads(threads)
    fixed = fixed_branches(caught)
    buf = io.BytesIO()
    torch.jit.save(traced, buf, _extra_files={META_NAME: json.dumps(
        {**info, "trace_fixed_branches": fixed})})
    data = buf.getvalue()
    loaded = torch.jit.load(io.BytesIO(data))
    return data, lambda x: loaded(x), fixed


def onnx_file(module, example, info: dict, label: str = "the answer"):
    """(the ONNX model's bytes, run(x) in onnxruntime, []), batch axis dynamic.

    The exporter is torch.export's (``dynamo=True``, needs onnxscript), the maintained one: it
    stops at a Python branch on a computed value instead of fixing it, and names the line. The
    legacy TorchScript-based exporter is deprecated, and it refuses the same answer heads (an
    operator ONNX lacks, where this one names the branch)."""
    import onnxruntime
    import torch
    from torch.export import Dim

    try:
        with torch.no_grad(), quiet():
            program = torch.onnx.export(module, (example,), dynamo=True, external_data=False,
                                        input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
                                        dynamic_shapes=({0: Dim("batch")},))
    except Exception as e:  # noqa: BLE001 - whatever the exporter cannot follow is a refusal
        raise ValueError(f"{label} cannot be exported to ONNX: {onnx_reason(e)}; "
                         f"--format torchscript may hold it") from None
    proto = program.model_proto
    for key, value in info.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, json.dumps(value)
    data = proto.SerializeToString()
    try:
        session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - e.g. an operator onnxruntime has no kernel for
        raise ValueError(f"onnxruntime cannot run the exported model: {first_line(e)}"
                         f"{dtype_hint(info)}") from None

    def run(x):
        return torch.as_tensor(session.run(None, {INPUT_NAME: x.numpy()})[0])
    return data, run, []


@contextlib.contextmanager
def quiet():
    """torch's own output kept from the terminal while the exporter runs: its progress lines,
    its notes on optional packages and, on a refusal, its logged dump of the whole graph
    (hundreds of lines, from loggers with handlers of their own and from C++), so a refusal is
    the one line of its exception. Logging is off, Python's and the file descriptors' stdout
    and stderr go to a discarded file, warnings are ignored; all restored after."""
    import logging
    import tempfile

    disabled = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = []
    sink = tempfile.TemporaryFile()
    try:
        for fd in (1, 2):
            try:
                saved.append((fd, os.dup(fd)))
                os.dup2(sink.fileno(), fd)
            except OSError:     # a descriptor that is not open: nothing to keep quiet there
                pass
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for fd, copy_of in saved:
            os.dup2(copy_of, fd)
            os.close(copy_of)
        sink.close()
        logging.disable(disabled)


def graph_refusal(problem, fmt: str) -> str:
    """The message refusing a graph format for an answer head that says it cannot be held in
    one (``AnswerHead.graph_branch``), before any tracing; "" when it does not say so."""
    head = getattr(problem, "head", None)
    why = getattr(head, "graph_branch", None) if fmt == "onnx" else None
    if not why:
        return ""
    return (f"the answer cannot be exported to ONNX: the answer head {head!r} of problem "
            f"{problem.name!r} cannot be held in a graph: {why}; --format torchscript holds "
            f"it (the branch fixed to the way the example takes)")


def onnx_reason(e: BaseException) -> str:
    """The exporter's reason in one line, with the line of code it stopped at if it says."""
    cause = e.__cause__ or e
    what = ("a Python branch on a computed value, which a graph cannot hold"
            if "data-dependent" in str(cause) else f"{type(cause).__name__}: {first_line(cause)}")
    lines = str(e).splitlines()
    for k, line in enumerate(lines[:-2]):
        m = re.search(r'File "(.+)", line (\d+), in (\S+)', lines[k + 1])
        if line.strip().startswith("The following call raised this error") and m:
            return f"{what}, at {source_path(m[1])}:{m[2]} in {m[3]} ({lines[k + 2].strip()})"
    return what


def source_path(filename: str) -> str:
    """``filename`` relative to the repository (the tracer's and exporter's messages name
    absolute paths)."""
    return os.path.relpath(filename, ROOT)


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def dtype_hint(info: dict) -> str:
    return "; onnxruntime's CPU convolutions are float32: add --dtype float32" \
        if info["dtype"] == "float64" else ""


def worst_difference(run, reference, problem, dtype, ref_dtype) -> float:
    """The worst relative L2 difference between the file and the eager answer over the
    :data:`CHECKS` draws (NaN when either is not finite); ValueError when the file fails to
    run on them or answers in another shape."""
    import torch

    worst = 0.0
    with torch.no_grad():
        for seed, n in CHECKS:
            x = draws(problem, seed, n, ref_dtype)
            ref = reference(x).double()
            try:
                got = run(x.to(dtype)).double()
            except Exception as e:  # noqa: BLE001 - a file that fails on other inputs is refused
                raise ValueError(f"the exported file fails on a batch of {n}: "
                                 f"{type(e).__name__}: {first_line(e)}: not written") from None
            if got.shape != ref.shape:
                raise ValueError(f"the exported file answers a batch of {n} in shape "
                                 f"{tuple(got.shape)}, the eager answer is "
                                 f"{tuple(ref.shape)}: not written")
            d = (got - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1).clamp_min(1e-300)
            worst = max(worst, float(d.max()) if bool(torch.isfinite(d).all()) else float("nan"))
    return worst


def write_bytes(path: str, data: bytes) -> None:
    from deepfusion.engine.checkpoint.atomic import atomic_path

    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


def export(path: str, fmt: str, out: str, *, grid=None, work_grid=None, options=None,
           dtype: str | None = None, notes: list | None = None) -> dict:
    """Export the checkpoint (or run directory) ``path`` to ``out``; returns the description
    stored in the file, with ``max_rel_diff`` (the check) and ``fixed_branches``. ``grid``,
    ``work_grid`` (default 'trained'), ``options``: as for ``deepfusion infer``; ``dtype``
    default: the checkpoint's. ``notes`` gets ``(level, text)`` lines for the user. ValueError
    for anything refused."""
    check_request(fmt, out, dtype, *checkpoint_paths(path))  # before torch is imported
    import torch

    from deepfusion.engine.predict.loader import load
    from deepfusion.engine.predict.service import answer_module

    notes = [] if notes is None else notes
    loaded = load(path, grid=grid, work_grid=work_grid or "trained", options=options,
                  notes=notes)
    model, problem, work, meta = loaded.model, loaded.problem, loaded.work, loaded.meta
    cells = loaded.correction
    if cells:   # autograd through the loss: no graph format holds it
        notes.append(("note", f"the run answers with a coarse correction (problem.correction "
                              f"= {cells}); the file answers without it, as the network does: "
                              f"apply diffnet.problems.coarse_correction to its answers "
                              f"(docs/coarse-correction.md)"))
    refused = graph_refusal(problem, fmt)
    if refused:   # known before tracing, which would take long only to stop at the branch
        raise ValueError(refused)
    ref_dtype = next(model.parameters()).dtype
    dtype = dtype or str(ref_dtype).removeprefix("torch.")
    reference = answer_module(model, problem, work)
    # The exporter follows the forward on its own copies: torch.export fills the problem's
    # caches (masks, the answer head's basis) with fake tensors.
    cast = copy.deepcopy(model).to(getattr(torch, dtype))
    module = answer_module(cast, copy.deepcopy(problem), copy.deepcopy(work))
    info = describe(problem, work, meta, loaded.path, fmt, dtype)
    example = draws(problem, *EXAMPLE, getattr(torch, dtype))
    make = torchscript_file if fmt == "torchscript" else onnx_file
    label = f"the answer (problem {problem.name!r}, answer head {problem.head!r})"
    data, run, fixed = make(module, example, info, label)
    diff = worst_difference(run, reference, problem, getattr(torch, dtype), ref_dtype)
    if not diff <= TOLERANCE:
        at = f"; the trace fixed the Python branches at {', '.join(fixed)}" if fixed else ""
        raise ValueError(f"the exported answer differs from the eager one by {diff:.3g} "
                         f"(relative L2, worst of {sum(n for _, n in CHECKS)} draws other than "
                         f"the traced example; tolerance {TOLERANCE:g}){at}: not written")
    said = loaded.grid_note(explicit=work_grid is not None)
    if said:
        notes.append(("note", said))
    write_bytes(out, data)
    return {**info, "max_rel_diff": diff, "fixed_branches": fixed, "bytes": len(data)}
