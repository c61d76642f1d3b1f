"""``deepfusion infer``, ``deepfusion solve`` and ``deepfusion compare`` (registered by cli.py).

Kept light on imports: torch is imported only after the thread layout is set (engine.layout).
Error policy as in :mod:`.policy`: input errors found on any rank end every rank with
exit code 2 and one message; out-of-range parameters are a WARNING; anything else aborts MPI.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from deepfusion.app.options import (ANSWER_SET_HELP, SOLVE_SET_HELP, add_set, add_threads,
                          problem_options)
from deepfusion.app.policy import ExitCode, collective_check, run_distributed, say_note, say_once

DEFAULT_SEED = 12345


def _input_args(p, what: str) -> None:
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
    p.add_argument("--out", required=True, metavar="FILE.h5", help=f"the {what} file to write")
    p.add_argument("--grid", metavar="HxW|DxHxW",
                   help="solve on another grid (rebuilds the problem; DxHxW for 3-D problems)")
    p.add_argument("--batch", type=int, default=8, metavar="B",
                   help="samples per batch and rank (bounds memory; default 8)")
    add_threads(p)


def register(sub) -> None:
    """Add the infer / solve / compare subcommands to the ``deepfusion`` parser."""
    i = sub.add_parser("infer", help="predict with a trained checkpoint (any number of ranks)")
    i.add_argument("checkpoint", help="a checkpoint file (run_dir/checkpoints/step_*.h5), or a "
                                      "run directory (its newest complete one)")
    _input_args(i, "predictions")
    i.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                   help="bf16 runs the generator's weights and activations in bfloat16 (faster "
                        "on CPUs with AMX/AVX512-BF16, ~3 significant digits; refused elsewhere)")
    i.add_argument("--work-grid", metavar="trained|as-is|HxW|DxHxW",
                   help="the grid the network runs on; its answer is interpolated to --grid. "
                        "Default 'trained': the checkpoint's training grid. 'as-is' (or "
                        "'none'): the network runs on --grid itself, which changes the "
                        "physical extent its filters and receptive field cover (they count "
                        "nodes), so its error there can be far above the training error")
    add_set(i, ANSWER_SET_HELP)
    i.add_argument("--refine", type=float, metavar="TOL",
                   help="refine each answer with the problem's iterative reference solver "
                        "(the network's answer is its initial guess) to the relative residual "
                        "TOL, e.g. 1e-8; the answer is then written in float64 with the "
                        "iterations and residuals per sample (docs/refine.md); refused for a "
                        "problem without such a solver")
    i.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                   help="record each answer's residual and whether it is above the problem's "
                        "threshold (/residual, /flagged; docs/answer-check.md). Default: on "
                        "where the problem has an answer residual; --check refuses a problem "
                        "without one")
    i.add_argument("--domain", metavar="PRxPC|PDxPRxPC",
                   help="split every field over ranks (domain parallelism, exact): blocks per "
                        "axis, e.g. 1x2; the ranks form groups of that many, each group "
                        "predicts whole samples block by block (a field too large for one "
                        "rank); default: no split")
    i.set_defaults(run=run_infer)
    s = sub.add_parser("solve", help="the classical reference solver on the same inputs")
    s.add_argument("--problem", required=True,
                   help="a registered problem ('deepfusion problems' lists them), "
                        "'package.module:ClassName' importable from PYTHONPATH, or a "
                        "plugin's entry-point name")
    add_set(s, SOLVE_SET_HELP)
    s.add_argument("--method", default="auto",
                   help="reference solver method, one of the problem's reference_methods "
                        "(default auto; e.g. the linear solver where the problem has a choice)")
    _input_args(s, "reference")
    s.set_defaults(run=run_solve)
    c = sub.add_parser("compare", help="errors and timings of predictions against references")
    c.add_argument("preds", help="file written by 'deepfusion infer'")
    c.add_argument("ref", help="file written by 'deepfusion solve'")
    c.add_argument("--out", metavar="DIR", help="directory for compare.json and compare.png "
                                                "(default: the directory of PREDS)")
    c.add_argument("--figures", type=int, default=3, help="samples shown (plus the worst)")
    c.set_defaults(run=run_compare)


# ---------------------------------------------------------------------------------------------
# shared steps
# ---------------------------------------------------------------------------------------------

def _threads(comm, requested: int, split: bool = False) -> None:
    """The thread layout, and freed memory kept for the next batch (as training keeps it:
    ``deepfusion.engine.parallel.memory``) unless the fields are split over ranks (``--domain``),
    where keeping it costs the most memory per rank."""
    from deepfusion.engine.parallel.layout import setup_threads
    from deepfusion.engine.parallel.memory import reuse_freed_memory

    setup_threads(comm, max(0, int(requested or 0)))
    say_note(comm, reuse_freed_memory(not split))


def _check_batch(args) -> None:
    if args.batch is None or args.batch < 1:
        raise ValueError(f"--batch must be a positive integer, got {args.batch}")


def _open_writer(rank: int, path, problem, samples, refined: bool = False,
                 checked: bool = False):
    from deepfusion.app.inference import open_writer

    return open_writer(path, problem, samples, refined, checked) if rank == 0 else None


def _inputs_note(args) -> str:
    if args.inputs:
        return f"inputs:{os.path.abspath(args.inputs)}"
    if args.params:
        return f"params:{os.path.abspath(args.params)}"
    return f"sample:{args.samples} seed:{args.seed}"


def _execute(comm, args, problem, samples, compute, attrs: dict, domain=None) -> int:
    """Open the output (rank 0), run every batch, publish the file and its XDMF sidecar;
    print one line."""
    from deepfusion.engine.parallel.memory import peak_rss_mib
    from deepfusion.engine.predict.refine import DATASETS, report
    from diffnet.problems import has_reference

    from deepfusion.app.inference import grid_text, run_blocks
    from deepfusion.app.xdmf import sidecar_path

    refine = getattr(args, "refine", None)
    checked = "residual_threshold" in attrs
    writer = collective_check(comm, _open_writer, comm.rank, args.out, problem, samples,
                              refine is not None, checked)
    t0 = time.perf_counter()
    try:
        busy = run_blocks(comm, samples.n, args.batch, compute, writer, domain)
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
                 f"{_check_text(flagged)} -> "
                 f"{os.path.abspath(args.out)} (ParaView: {sidecar_path(os.path.abspath(args.out))})", err=False)
    for w in refined["warnings"]:
        say_once(comm, f"deepfusion: WARNING: {w}")
    if flagged is not None and flagged.any():   # rank 0, which holds the file
        bad = flagged.nonzero()[0].tolist()
        say_once(comm, f"deepfusion: WARNING: {len(bad)} of {samples.n} answers have a "
                       f"residual above {attrs['residual_threshold']:g}, the threshold of "
                       f"problem {problem.name!r}: do not trust them (samples {bad[:10]}"
                       f"{' ...' if len(bad) > 10 else ''}; /residual and /flagged in "
                       f"{os.path.abspath(args.out)}, docs/answer-check.md)")
    return 0


def _check_text(flagged) -> str:
    """The summary line's part on the check (rank 0; empty without one)."""
    return "" if flagged is None else f"; residual checked: {int(flagged.sum())} flagged"


def _samples(comm, args, problem):
    from deepfusion.app.samples import resolve_samples

    problem, samples, warns = collective_check(
        comm, lambda: resolve_samples(problem, sample=args.samples, seed=args.seed,
                                      params=args.params, inputs=args.inputs))
    for w in warns:
        say_once(comm, f"deepfusion: WARNING: {w}")
    return problem, samples


# ---------------------------------------------------------------------------------------------
# infer
# ---------------------------------------------------------------------------------------------

def _load(args):
    from deepfusion.app.inference import checkpoint_file, load_model, parse_grid

    _check_batch(args)
    if args.precision == "bf16":
        from deepfusion.engine.parallel.layout import check_precision

        check_precision("bf16", setting="--precision {}")
    args.checkpoint_notes = []  # which checkpoint of a run directory, and why: said once
    args.checkpoint = checkpoint_file(args.checkpoint, args.checkpoint_notes)
    args.options = problem_options(args, "infer")
    model, problem, work, meta = load_model(args.checkpoint, parse_grid(args.grid),
                                            work_grid=_work_grid(args), options=args.options)
    if args.precision == "bf16":
        import torch

        model = model.to(torch.bfloat16)
    return model, problem, work, meta


def _infer(args, comm) -> int:
    from deepfusion.app.inference import (grid_note, grid_text, predictor, trained_config, warmup_pays,
                            work_problem)

    _threads(comm, args.threads, split=bool(args.domain))
    model, problem, work, meta = collective_check(comm, _load, args)
    for level, text in args.checkpoint_notes:
        say_once(comm, f"deepfusion: {level}: {text}")
    problem, samples = _samples(comm, args, problem)
    if args.inputs:  # the file set the grid: refuse one the network cannot run on, up front
        work = collective_check(comm, work_problem, model, problem, meta, _work_grid(args),
                                f"--inputs {args.inputs} holds {grid_text(problem.grid)} fields")
    data_seed = trained_config(meta, "data").get("seed")
    if args.samples is not None and data_seed is not None and args.seed == data_seed:
        say_once(comm, f"deepfusion: WARNING: --seed {args.seed} is the training seed "
                       f"(data.seed): these samples are the training pool, not unseen inputs")
    if args.refine is not None:   # refused up front, before any network runs
        from deepfusion.engine.predict.refine import check_refine

        collective_check(comm, check_refine, problem, args.refine, "--refine")
    cl = bool(trained_config(meta, "model").get("channels_last", False))
    domain = _split(comm, args, model, work or problem)
    note = grid_note(model, meta, problem.grid, work, explicit=args.work_grid is not None)
    if note:
        say_once(comm, f"deepfusion: note: {note}")
    warm = warmup_pays(samples.n, args.batch, domain.groups if domain else comm.size)
    check = collective_check(comm, _check, args, problem)
    compute = predictor(model, problem, samples, channels_last=cl, work=work, domain=domain,
                        warmup=warm, refine=args.refine, check=check)
    attrs = {"warmup": warm, "source": os.path.abspath(args.checkpoint), "kind": "prediction",
             "step": int(meta.get("step", -1)),
             "work_grid": list((work or problem).grid),
             "domain": list(domain.split) if domain else [],
             "options": args.options}
    if check:
        attrs["residual_threshold"] = float(problem.residual_threshold)
    return _execute(comm, args, problem, samples, compute, attrs, domain)


def _check(args, problem) -> bool:
    """Whether infer checks its answers: --check / --no-check, by default where the problem
    has an answer residual; ValueError for --check on a problem without one."""
    if args.check and problem.residual_threshold is None:
        raise ValueError(f"--check: problem {problem.name!r} has no answer residual (its "
                         f"residual_threshold is None); run without --check")
    return problem.residual_threshold is not None if args.check is None else args.check


def _work_grid(args) -> str:
    """--work-grid as given, else the default: the training grid."""
    return "trained" if args.work_grid is None else args.work_grid


def _split(comm, args, model, on):
    """The domain split of --domain over the ranks, the model and the problem ``on`` (the grid
    the network runs on) set to compute on this rank's block, as training splits them
    (``deepfusion.engine.predict.pipeline.split_for_prediction``); None without --domain."""
    from deepfusion.engine.predict.pipeline import check_split, split_for_prediction
    from deepfusion.app.inference import grid_text, parse_grid

    if not args.domain:
        return None

    def check():
        split = parse_grid(args.domain) if "x" in str(args.domain) else None
        if split is None or len(split) != len(on.grid):
            raise ValueError(f"--domain must give one block count per axis of the "
                             f"{grid_text(on.grid)} grid, e.g. {'x'.join(['1'] * (len(on.grid) - 1) + ['2'])}, "
                             f"got {args.domain!r}")
        check_split(comm.size, split, model, on.grid, f"--domain {args.domain}")
        return split
    return split_for_prediction(comm, collective_check(comm, check), model, on)


def run_infer(args) -> int:
    return run_distributed(_infer, args)


# ---------------------------------------------------------------------------------------------
# solve
# ---------------------------------------------------------------------------------------------

def _build_solve(args):
    from deepfusion.app.inference import build_problem, parse_grid

    _check_batch(args)
    opts = problem_options(args, "solve")
    if "grid" in opts:
        raise ValueError("problem.options.grid: give the grid with --grid HxW (DxHxW)")
    return build_problem(args.problem, opts, parse_grid(args.grid))


def _solve(args, comm) -> int:
    from deepfusion.app.inference import make_solver, solver_compute

    _threads(comm, args.threads)
    problem = collective_check(comm, _build_solve, args)
    problem, samples = _samples(comm, args, problem)
    solve = collective_check(comm, make_solver, problem, samples, args.method)
    compute = solver_compute(problem, samples, solve)
    attrs = {"source": f"reference:{args.method}", "kind": "reference"}
    return _execute(comm, args, problem, samples, compute, attrs)


def run_solve(args) -> int:
    return run_distributed(_solve, args)


# ---------------------------------------------------------------------------------------------
# compare (one process)
# ---------------------------------------------------------------------------------------------

def run_compare(args) -> int:
    from deepfusion.app.compare import compare_files

    try:
        out_dir = args.out or os.path.dirname(os.path.abspath(args.preds))
        summary, table = compare_files(args.preds, args.ref, out_dir, n_figures=args.figures)
    except (ValueError, OSError, KeyError) as e:
        print(f"deepfusion: error: {e}", file=sys.stderr, flush=True)
        return ExitCode.INPUT
    print(table, flush=True)
    return 0
