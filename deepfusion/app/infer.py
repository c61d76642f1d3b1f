"""``deepfusion infer``: predictions of a trained checkpoint on any number of ranks, written to a
fields file.

Through the prediction service (:mod:`deepfusion.engine.predict.service`): the checkpoint
loaded for prediction, the pipeline on the work grid, the ``contiguous_batches`` share over the
ranks (global batches [k B, (k + 1) B) divided over the ranks in contiguous blocks, so every
sample goes through the network in the same batch whatever the number of ranks: identical
bytes for any P), and rank 0's sink writing the file (one gather a round: P batches in memory
at a time). With ``--domain`` the ranks form groups that compute each field block by block.

Kept light on imports: torch is imported only after the thread layout is set (engine.layout).
Error policy as in :mod:`.policy`: input errors found on any rank end every rank with
exit code 2 and one message; out-of-range parameters are a WARNING; anything else aborts MPI.
"""
from __future__ import annotations

import argparse
import os

from deepfusion.app.fields_run import (check_batch, check_out, execute, input_args, resolve,
                                       set_threads)
from deepfusion.app.options import (ANSWER_SET_HELP, add_correction, add_set, correction_of,
                                    problem_options)
from deepfusion.app.outputs import checkpoint_paths
from deepfusion.app.policy import collective_check, run_distributed, say_once


def register(sub) -> None:
    """Add the infer subcommand to the ``deepfusion`` parser."""
    i = sub.add_parser("infer", help="predict with a trained checkpoint (any number of ranks)")
    i.add_argument("checkpoint", help="a checkpoint file (run_dir/checkpoints/step_*.h5), or a "
                                      "run directory (its newest complete one)")
    input_args(i, "predictions")
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
    add_correction(i)
    i.add_argument("--refine", type=float, metavar="TOL",
                   help="refine each answer with the problem's iterative reference solver "
                        "(the network's answer is its initial guess) to the relative residual "
                        "TOL, e.g. 1e-8; the answer is then written in float64 with the "
                        "iterations and residuals per sample (docs/refine.md); refused for a "
                        "problem without such a solver")
    i.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                   help="record each answer's residual and whether it is above the threshold "
                        "calibrated for the model (else the problem's constant one; "
                        "/residual, /flagged; docs/answer-check.md). Default: on (every "
                        "problem has an answer residual, from its loss if not its own)")
    i.add_argument("--domain", metavar="PRxPC|PDxPRxPC",
                   help="split every field over ranks (domain parallelism, exact): blocks per "
                        "axis, e.g. 1x2; the ranks form groups of that many, each group "
                        "predicts whole samples block by block (a field too large for one "
                        "rank); default: no split")
    i.set_defaults(run=run_infer)


def run_infer(args) -> int:
    return run_distributed(_infer, args)


def _load(args):
    """The checkpoint loaded for prediction (the service's loader), bf16 if asked."""
    from deepfusion.engine.predict.loader import load, parse_grid

    check_batch(args)
    if args.precision == "bf16":
        from deepfusion.engine.parallel.layout import check_precision

        check_precision("bf16", setting="--precision {}")
    args.options = problem_options(args, "infer")
    loaded = load(args.checkpoint, grid=parse_grid(args.grid), work_grid=_work_grid(args),
                  options=args.options)
    args.correction = correction_of(args.correction, loaded, loaded.work or loaded.problem)
    if args.correction and args.domain:
        raise ValueError(f"--domain splits each answer over ranks, and the coarse correction "
                         f"({args.correction} cells, the run's problem.correction unless "
                         f"--correction is given) needs it whole on one: give --correction 0 "
                         f"or no --domain")
    if args.precision == "bf16":
        import torch

        loaded.model = loaded.model.to(torch.bfloat16)
    return loaded


def _infer(args, comm) -> int:
    from diffnet.problems import residual_kind

    from deepfusion.engine.predict import service
    from deepfusion.engine.predict.calibration import threshold_for
    from deepfusion.engine.predict.loader import grid_text, work_problem

    check_out(comm, args, *checkpoint_paths(args.checkpoint))  # before anything is loaded
    set_threads(comm, args.threads, split=bool(args.domain))
    if args.precision == "bf16" and args.domain:
        from deepfusion.engine.parallel.layout import avoid_amx_under_a_split

        note = avoid_amx_under_a_split()            # before the first bf16 convolution
        if note and comm.rank == 0:
            print(note, flush=True)
    loaded = collective_check(comm, _load, args)
    model, meta = loaded.model, loaded.meta
    for level, text in loaded.notes:
        say_once(comm, f"deepfusion: {level}: {text}")
    problem, samples = resolve(comm, args, loaded.problem)
    work = loaded.work
    if args.inputs:  # the file set the grid: refuse one the network cannot run on, up front
        work = collective_check(comm, work_problem, model, problem, meta, _work_grid(args),
                                f"--inputs {args.inputs} holds {grid_text(problem.grid)} fields")
    if args.samples is not None:
        for text in loaded.seed_notes(args.seed):
            say_once(comm, f"deepfusion: WARNING: {text}")
    if args.refine is not None:   # refused up front, before any network runs
        from deepfusion.engine.predict.refine import check_refine

        collective_check(comm, check_refine, problem, args.refine, "--refine")
    domain = _split(comm, args, model, work or problem)
    note = loaded.grid_note(args.work_grid is not None, problem, work)
    if note:
        say_once(comm, f"deepfusion: note: {note}")
    warm = service.warmup_pays(samples.n, args.batch, service.unit_of(comm, domain)[1])
    check = collective_check(comm, _check, args, problem)
    threshold = threshold_for(meta, problem) if check else None
    pipe = service.pipeline(model, problem, work=work, channels_last=loaded.channels_last,
                            domain=domain, correction=args.correction)
    compute = service.Predictor(pipe, samples, warmup=warm, finish=service.as_arrays(
        problem, samples, refine=args.refine, check=check,
        threshold=threshold.value if threshold is not None else None))
    attrs = {"warmup": warm, "source": os.path.abspath(loaded.path), "kind": "prediction",
             "step": loaded.step,
             "work_grid": list((work or problem).grid),
             "domain": list(domain.split) if domain else [],
             "options": args.options, "correction": args.correction}
    if threshold is not None:   # NaN: no threshold (only non-finite answers are flagged)
        attrs["residual_threshold"] = float("nan") if threshold.value is None \
            else threshold.value
        attrs["residual_threshold_source"] = threshold.source
        attrs["residual_threshold_text"] = threshold.text
        attrs["residual_kind"] = residual_kind(problem)
    return execute(comm, args, problem, samples, compute, attrs, domain)


def _check(args, problem) -> bool:
    """Whether infer checks its answers: --check / --no-check, by default where the problem
    has an answer residual (every Problem: its own, or its loss's); ValueError for --check on
    a problem without one."""
    from diffnet.problems import has_answer_residual

    if args.check and not has_answer_residual(problem):
        raise ValueError(f"--check: problem {problem.name!r} has no answer residual (it does "
                         f"not define answer_residual); run without --check")
    return has_answer_residual(problem) if args.check is None else args.check


def _work_grid(args) -> str:
    """--work-grid as given, else the default: the training grid."""
    return "trained" if args.work_grid is None else args.work_grid


def _split(comm, args, model, on):
    """The domain split of --domain over the ranks, the model and the problem ``on`` (the grid
    the network runs on) set to compute on this rank's block, as training splits them
    (``deepfusion.engine.predict.pipeline.split_for_prediction``); None without --domain."""
    from deepfusion.engine.predict.loader import grid_text, parse_grid
    from deepfusion.engine.predict.pipeline import check_split, split_for_prediction

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
