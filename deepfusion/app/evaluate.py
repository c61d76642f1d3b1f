"""``deepfusion evaluate``: a checkpoint's error on a test draw never used for tuning (default
``data.test_seed``), on any number of ranks.

The checkpoint is loaded by the prediction service's loader
(:func:`deepfusion.engine.predict.loader.load`) and evaluated as validation evaluates
(:func:`deepfusion.engine.predict.evaluate.evaluate`: the service, strided draws per rank).
Rank 0 writes the summary (default ``RUN_DIR/eval_seed<SEED>.json``) and prints one line.

Kept light on imports: torch is imported only after the thread layout is set (engine.layout).
"""
from __future__ import annotations

import json
import os

from deepfusion.app.options import (ANSWER_SET_HELP, add_correction, add_set, add_threads,
                                    correction_of, problem_options)
from deepfusion.config.files import as_set_flags
from deepfusion.app.outputs import check_output, checkpoint_paths
from deepfusion.app.policy import collective_check, run_distributed, say_note, say_once


def register(sub) -> None:
    """Add the evaluate subcommand to the ``deepfusion`` parser."""
    e = sub.add_parser("evaluate", help="relative L2 of a checkpoint on a test draw never used "
                                        "for tuning (any number of ranks)")
    e.add_argument("checkpoint", help="a checkpoint file, or a run directory (its newest one)")
    e.add_argument("--seed", type=int, default=None,
                   help="seed of the draws (default: the run's data.test_seed)")
    e.add_argument("--samples", type=int, default=None, metavar="N",
                   help="number of draws (default: the run's data.test_samples)")
    e.add_argument("--out", metavar="FILE.json",
                   help="summary file (default RUN_DIR/eval_seed<SEED>.json); its directory "
                        "must exist, and it is never the checkpoint or another file of a run")
    add_threads(e)
    add_set(e, ANSWER_SET_HELP)
    add_correction(e)
    e.set_defaults(run=lambda args: run_distributed(cmd_evaluate, args))


def evaluation_target(args):
    """(checkpoint loaded for prediction, seed, n, warnings) for ``deepfusion evaluate``."""
    from deepfusion.engine.predict.loader import load

    args.options = problem_options(args, "evaluate")  # parsed once, here, under collective_check
    loaded = load(args.checkpoint, options=args.options)
    data = loaded.data()
    seed = data["test_seed"] if args.seed is None else args.seed
    n = data["test_samples"] if args.samples is None else args.samples
    if n < 1:
        raise ValueError(f"--samples must be >= 1, got {n}")
    args.correction = correction_of(args.correction, loaded, loaded.problem)
    return loaded, seed, n, loaded.seed_notes(seed, held_out=True)


def check_out(args, rank: int) -> None:
    """--out checked on rank 0 (the writer) before the evaluation; a run's own evaluation
    summaries (``eval_seed*.json``, the default) are allowed."""
    if args.out and rank == 0:
        inputs, runs = checkpoint_paths(args.checkpoint)
        check_output(args.out, flag="--out", inputs=inputs, run_dirs=runs,
                     allow=("eval_seed*.json",))


def cmd_evaluate(args, comm) -> int:
    """Relative L2 of a checkpoint on a test draw (default ``data.test_seed``, never tuned on)."""
    collective_check(comm, check_out, args, comm.rank)
    from deepfusion.engine.parallel.layout import setup_threads
    from deepfusion.engine.parallel.memory import reuse_freed_memory

    setup_threads(comm, max(0, int(args.threads or 0)))  # before torch is imported
    say_note(comm, reuse_freed_memory(True))  # as infer: the batches fault memory in once
    from deepfusion.engine.parallel.memformat import convert_model
    from deepfusion.engine.predict.evaluate import evaluate, quantity, summary_text
    from deepfusion.engine.predict.loader import grid_text

    loaded, seed, n, notes = collective_check(comm, evaluation_target, args)
    for level, text in loaded.notes:
        say_once(comm, f"deepfusion: {level}: {text}")
    for note in notes:
        say_once(comm, f"deepfusion: WARNING: {note}")
    cl, path, problem = loaded.channels_last, loaded.path, loaded.problem
    dtype = next(loaded.model.parameters()).dtype
    model = convert_model(loaded.model, cl)
    summary = evaluate(model, problem, comm, n=n, seed=seed, dtype=dtype, channels_last=cl,
                       check=True, correction=args.correction)
    if summary is None:
        return 0
    summary.pop("_examples")
    checked = answer_check(summary, loaded.meta, problem)
    out = args.out or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(path))),
                                   f"eval_seed{seed}.json")
    with open(out, "w") as f:
        json.dump({"checkpoint": os.path.abspath(path), "step": loaded.meta.get("step"),
                   "grid": list(problem.grid), "options": args.options,
                   "correction": args.correction, **summary}, f, indent=1)
    kind = "test" if not notes else "NOT a test draw:"
    given = " ".join(filter(None, [as_set_flags(args.options), f"--correction "
                                   f"{args.correction}" if args.correction else ""]))
    print(f"{kind} {quantity(summary)} over {n} draws (seed {seed}) of {os.path.basename(path)}"
          f" on {grid_text(problem.grid)}{' with ' + given if given else ''}: "
          f"{summary_text(summary)} -> {out}", flush=True)
    if checked:
        print(checked, flush=True)
    return 0


def answer_check(summary: dict, meta: dict, problem) -> str:
    """The answer check of the evaluated draws, into ``summary`` ("answer_check": the
    threshold the checkpoint gives (:func:`~deepfusion.engine.predict.calibration.threshold_for`),
    where it came from, each draw's flag, how many bad answers (above 5%) and good ones it
    flags), and its line for the output; "" without a reference solver (no errors)."""
    import numpy as np

    from deepfusion.engine.predict.calibration import ERROR_LEVEL, threshold_for

    if "residual" not in summary:
        return ""
    t = threshold_for(meta, problem)
    flagged = t.flags(summary["residual"])
    bad = np.asarray(summary["rel_l2"]) > ERROR_LEVEL
    counts = {"bad": int(bad.sum()), "bad_flagged": int((flagged & bad).sum()),
              "good": int((~bad).sum()), "good_flagged": int((flagged & ~bad).sum())}
    summary["answer_check"] = {"threshold": t.value, "source": t.source, "text": t.text,
                               "error": ERROR_LEVEL, "flagged": flagged.tolist(), **counts}
    return (f"answer check: {int(flagged.sum())} of {len(flagged)} answers flagged; "
            f"{counts['bad_flagged']} of {counts['bad']} with an error above "
            f"{ERROR_LEVEL:.0%}, {counts['good_flagged']} of {counts['good']} below (threshold "
            f"{t.text})")
