"""What ``deepfusion infer`` and ``deepfusion solve`` share: their input flags, the thread
setup, the samples, and the run of every batch over the ranks into a fields file
(:func:`execute`: the prediction service's :func:`~deepfusion.engine.predict.service.run_blocks`,
rank 0 writing).

Kept light on imports: torch is imported only after the thread layout is set (engine.layout).
Files: see :mod:`deepfusion.app.fields_file`.
"""
from __future__ import annotations

import os
import time

from deepfusion.app.options import add_threads
from deepfusion.app.outputs import check_output
from deepfusion.app.policy import collective_check, say_note, say_once

DEFAULT_SEED = 12345


def input_args(p, what: str) -> None:
    """The flags of the samples (exactly one of --samples / --params / --inputs), --out,
    --grid, --batch and --threads."""
    g = p.add_argument_group("inputs (exactly one of --samples / --params / --inputs)")
    g.add_argument("--samples", type=int, metavar="N",
                   help="N fresh draws from the problem's parameter range")
    g.add_argument("--seed", type=int, default=DEFAULT_SEED,
                   help=f"seed of the --samples draws (default {DEFAULT_SEED}; draw j depends "
                        f"only on (seed, j), so infer and solve with the same seed match)")
    g.add_argument("--params", metavar="FILE",
                   help="parameter vectors, one per line (text/CSV, optional header of names) "
                        "or an HDF5 file with /params (n, k)")
    g.add_argument("--inputs", metavar="FILE.h5",
                   help="input fields given directly: /inputs (N, C, H, W) (3-D problems: "
                        "(N, C, D, H, W)) with attribute "
                        "'channels' naming them after the problem's input channels (a problem "
                        "may derive a missing channel from another, e.g. a logarithm)")
    p.add_argument("--out", required=True, metavar="FILE.h5", help=f"the {what} file to write (its directory must exist; never one of the "
                        f"inputs, a checkpoint or a file of a run directory)")
    p.add_argument("--grid", metavar="HxW|DxHxW",
                   help="solve on another grid (rebuilds the problem; DxHxW for 3-D problems)")
    p.add_argument("--batch", type=int, default=8, metavar="B",
                   help="samples per batch and rank (bounds memory; default 8)")
    add_threads(p)


def set_threads(comm, requested: int, split: bool = False) -> None:
    """The thread layout, and freed memory kept for the next batch (as training keeps it:
    ``deepfusion.engine.parallel.memory``) unless the fields are split over ranks (``--domain``),
    where keeping it costs the most memory per rank."""
    from deepfusion.engine.parallel.layout import setup_threads
    from deepfusion.engine.parallel.memory import reuse_freed_memory

    setup_threads(comm, max(0, int(requested or 0)))
    say_note(comm, reuse_freed_memory(not split))


def check_batch(args) -> None:
    if args.batch is None or args.batch < 1:
        raise ValueError(f"--batch must be a positive integer, got {args.batch}")


def resolve(comm, args, problem):
    """(problem, Samples) of --samples / --params / --inputs (the file may set the grid); the
    warnings said once."""
    from deepfusion.app.samples import resolve_samples

    problem, samples, warns = collective_check(
        comm, lambda: resolve_samples(problem, sample=args.samples, seed=args.seed,
                                      params=args.params, inputs=args.inputs))
    for w in warns:
        say_once(comm, f"deepfusion: WARNING: {w}")
    return problem, samples


def check_out(comm, args, inputs=(), run_dirs=()) -> None:
    """--out checked on rank 0 (the writer) before any work: not --inputs / --params nor any
    of ``inputs``, not a run's checkpoint or file (:func:`deepfusion.app.outputs.check_output`);
    InputError on every rank otherwise."""
    def check():
        if comm.rank == 0:
            check_output(args.out, flag="--out", inputs=(args.inputs, args.params, *inputs),
                         run_dirs=run_dirs)
    collective_check(comm, check)


def open_writer(path, problem, samples, refined: bool = False, checked: bool = False):
    """The output file's writer (rank 0 only), sized for all samples; ``refined``: float64
    answers and the refinement's per-sample records (``deepfusion.engine.predict.refine``);
    ``checked``: the answers' residuals and flags (``fields_file.CHECK_DATASETS``)."""
    from deepfusion.app import fields_file as h5io
    from deepfusion.engine.predict.refine import DATASETS

    axes = [a.name for a in problem.axes]
    names = list(problem.param_names) if samples.params.shape[1] else []
    extra = {name: dtype for name, (dtype, _) in DATASETS.items()} if refined else {}
    extra.update(h5io.CHECK_DATASETS if checked else {})
    return h5io.FieldWriter(path, n=samples.n, grid=problem.grid,
                            channels=problem.input_channels, params=samples.params,
                            param_names=names, coords=problem.coords(), axes=axes,
                            u_dtype="float64" if refined else "float32", extra=extra)


def _writer_on(rank: int, path, problem, samples, refined: bool, checked: bool):
    return open_writer(path, problem, samples, refined, checked) if rank == 0 else None


def _inputs_note(args) -> str:
    if args.inputs:
        return f"inputs:{os.path.abspath(args.inputs)}"
    if args.params:
        return f"params:{os.path.abspath(args.params)}"
    return f"sample:{args.samples} seed:{args.seed}"


def execute(comm, args, problem, samples, compute, attrs: dict, domain=None) -> int:
    """Open the output (rank 0), run every batch through ``compute(lo, hi) -> Batch`` over the
    ranks (the service's :func:`~deepfusion.engine.predict.service.run_blocks`), publish the
    file and its XDMF sidecar; print one line."""
    from deepfusion.engine.parallel.memory import peak_rss_mib
    from deepfusion.engine.predict.loader import grid_text
    from deepfusion.engine.predict.refine import DATASETS, report
    from deepfusion.engine.predict.service import run_blocks
    from diffnet.problems import has_reference

    from deepfusion.app.xdmf import sidecar_path

    refine = getattr(args, "refine", None)
    checked = "residual_threshold" in attrs
    writer = collective_check(comm, _writer_on, comm.rank, args.out, problem, samples,
                              refine is not None, checked)
    sink = None if writer is None else (lambda b: writer.write(b.lo, b.u, b.inputs, b.extra))
    t0 = time.perf_counter()
    try:
        busy = run_blocks(comm, samples.n, args.batch, compute, sink, domain)
        wall = time.perf_counter() - t0
        # Every rank's high-water mark, so a user can size --batch or --domain for the next run.
        peaks = [round(m, 1) for m in comm.allgather_obj(peak_rss_mib())]
        held = writer is not None and refine is not None
        refined = report({k: writer.f[k][()] for k in DATASETS} if held else None, refine)
        flagged = writer.f["flagged"][()] if writer is not None and checked else None
        if writer is not None:
            writer.close({**attrs, "problem": problem.name, "problem_kwargs": problem.config(),
                          "has_reference": has_reference(problem),
                          "seconds_per_sample": busy / samples.n, "wall_seconds": wall,
                          "ranks": comm.size, "batch": args.batch, "inputs_from": _inputs_note(args),
                          "peak_rss_mib_per_rank": peaks, **refined["attrs"]})
    except BaseException:
        if writer is not None:
            writer.discard()
        raise
    cold = "" if attrs.get("warmup", True) else \
        " (one batch per rank: no warm-up, kernel selection included)"
    say_once(comm, f"{attrs['kind']}: {samples.n} samples of {problem.name} "
                 f"{grid_text(problem.grid)} on {comm.size} rank(s): "
                 f"{busy / samples.n:.4g} s/sample compute{cold}, {wall:.3g} s wall, "
                 f"peak memory {max(peaks):.0f} MiB on the largest rank{refined['text']}"
                 f"{_check_text(flagged, attrs)} -> "
                 f"{os.path.abspath(args.out)} (ParaView: {sidecar_path(os.path.abspath(args.out))})", err=False)
    for w in refined["warnings"]:
        say_once(comm, f"deepfusion: WARNING: {w}")
    if flagged is not None and flagged.any():   # rank 0, which holds the file
        bad = flagged.nonzero()[0].tolist()
        t = attrs["residual_threshold"]
        above = "a non-finite residual" if t != t else f"a residual above {t:g}"   # NaN: none
        say_once(comm, f"deepfusion: WARNING: {len(bad)} of {samples.n} answers have "
                       f"{above}: do not trust them (samples {bad[:10]}"
                       f"{' ...' if len(bad) > 10 else ''}; /residual and /flagged in "
                       f"{os.path.abspath(args.out)}, docs/answer-check.md)")
    return 0


# where the threshold came from (deepfusion.engine.predict.calibration.threshold_for), for the
# summary line; the file's attribute residual_threshold_text says it whole
THRESHOLD_WORDS = {"calibrated": "calibrated for this model",
                   "family": "the problem's constant: the checkpoint has none calibrated, "
                             "'deepfusion calibrate' writes one",
                   "none": "none: only non-finite answers are flagged; 'deepfusion "
                           "calibrate' writes one"}


def _check_text(flagged, attrs: dict) -> str:
    """The summary line's part on the check (rank 0; empty without one): how many answers
    are flagged, and by which threshold."""
    if flagged is None:
        return ""
    t, source = attrs["residual_threshold"], attrs.get("residual_threshold_source")
    value = "" if t != t else f"{t:.3g}, "
    return (f"; residual checked: {int(flagged.sum())} flagged (threshold {value}"
            f"{THRESHOLD_WORDS.get(source, source)})")
