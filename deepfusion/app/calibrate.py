"""``deepfusion calibrate``: the answer check's threshold of a trained checkpoint, calibrated on
fresh draws with references and written into the checkpoint; and the same at the end of
``deepfusion train`` (:func:`after_training`), from its final validation.

The rule and what is stored: :mod:`deepfusion.engine.predict.calibration` (the residual of a
5% error, read off the draws' residual-vs-error slope at a low quantile). The draws are evaluated
as ``deepfusion evaluate`` evaluates (any number of ranks, the reference solver on each draw);
rank 0 chooses the threshold and writes the checkpoint back whole, atomically and sealed,
holding the run directory's lock for the write (refused while a training job holds it).

Kept light on imports: torch is imported only after the thread layout is set (engine.layout).
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager, nullcontext

from deepfusion.app.options import add_threads
from deepfusion.app.policy import collective_check, run_distributed, say_note, say_once

SEED = 314159      # the default draws: apart from data.seed, eval_seed and test_seed's defaults
SAMPLES = 32


def register(sub) -> None:
    """Add the calibrate subcommand to the ``deepfusion`` parser."""
    c = sub.add_parser("calibrate", help="calibrate the threshold that flags a checkpoint's "
                                         "answers, on fresh draws (any number of ranks)")
    c.add_argument("checkpoint", help="a checkpoint file, or a run directory (its newest one): "
                                      "its metadata gets the threshold")
    c.add_argument("--samples", type=int, default=SAMPLES, metavar="N",
                   help=f"draws to calibrate on, each solved by the reference solver "
                        f"(default {SAMPLES})")
    c.add_argument("--seed", type=int, default=SEED,
                   help=f"seed of the draws (default {SEED}; not the run's training, "
                        f"validation or test seed, so later tests stay unseen)")
    c.add_argument("--error", type=float, default=0.05, metavar="E",
                   help="the relative L2 error above which an answer is bad: the threshold is "
                        "the residual of an answer of that error (default 0.05)")
    add_threads(c)
    c.set_defaults(run=lambda args: run_distributed(cmd_calibrate, args))


def target(args):
    """(checkpoint loaded for prediction, warnings) for ``deepfusion calibrate``;
    ValueError for what cannot be calibrated."""
    from diffnet.problems import has_reference

    from deepfusion.engine.predict.calibration import LEAST_DRAWS
    from deepfusion.engine.predict.loader import load

    if args.samples is None or args.samples < LEAST_DRAWS:
        raise ValueError(f"--samples must be at least {LEAST_DRAWS} (a threshold is a "
                         f"quantile over the draws' residuals and errors), got {args.samples}")
    if not 0 < args.error < 1:
        raise ValueError(f"--error must be a relative error in (0, 1), e.g. 0.05, got "
                         f"{args.error}")
    loaded = load(args.checkpoint)
    if not has_reference(loaded.problem):
        raise ValueError(f"problem {loaded.problem.name!r} has no reference solver: a "
                         f"threshold is calibrated against the errors of answers, which need "
                         f"one; its answers are checked against the family's "
                         f"residual_threshold, if it sets one")
    data = loaded.data()
    used = {data["seed"]: "training seed (data.seed)",
            data["eval_seed"]: "validation seed (data.eval_seed)",
            data["test_seed"]: "test seed (data.test_seed)"}
    warns = [f"--seed {args.seed} is the run's {used[args.seed]}: draws it has seen or will "
             f"be measured on"] if args.seed in used else []
    return loaded, warns


def cmd_calibrate(args, comm) -> int:
    from deepfusion.engine.parallel.layout import setup_threads

    setup_threads(comm, max(0, int(args.threads or 0)))  # before torch is imported
    from deepfusion.engine.parallel.memformat import convert_model
    from deepfusion.engine.predict.evaluate import evaluate

    loaded, warns = collective_check(comm, target, args)
    for level, text in loaded.notes:
        say_once(comm, f"deepfusion: {level}: {text}")
    for w in warns:
        say_once(comm, f"deepfusion: WARNING: {w}")
    cl, problem = loaded.channels_last, loaded.problem
    dtype = next(loaded.model.parameters()).dtype
    summary = evaluate(convert_model(loaded.model, cl), problem, comm, n=args.samples,
                       seed=args.seed, dtype=dtype, channels_last=cl, check=True)
    rec = collective_check(comm, store, summary, loaded.path, problem, loaded.step,
                           args.error, "deepfusion calibrate", True)
    if rec is not None:
        say_once(comm, f"{summary_line(rec)} -> {os.path.abspath(loaded.path)}", err=False)
    return 0


def summary_line(rec: dict) -> str:
    from deepfusion.engine.predict.calibration import summary_line as line

    return line(rec)


def store(summary, path: str, problem, step: int, error: float, by: str,
          lock: bool) -> dict | None:
    """Rank 0 (the one with ``summary``): the calibration of the evaluated draws, written into
    checkpoint ``path`` (under the run directory's lock, with ``lock``). ValueError (every
    rank refuses, by the caller's collective check) when the draws cannot calibrate."""
    if summary is None:
        return None
    from diffnet.problems import residual_kind

    from deepfusion.engine.predict import calibration

    cal = calibration.calibrate(summary["residual"], summary["rel_l2"], error=error)
    rec = calibration.record(cal, kind=residual_kind(problem), grid=problem.grid,
                             seed=summary["seed"], step=step, by=by)
    with run_dir_lock(path) if lock else nullcontext():
        calibration.write(path, rec)
    return rec


@contextmanager
def run_dir_lock(path: str):
    """Hold the lock of the run directory of checkpoint ``path`` (RUN_DIR/checkpoints/...)
    for one write: refused (RunDirInUse, a ValueError) while a training job holds it. A
    checkpoint file outside a run directory has no lock (no job writes next to it)."""
    from deepfusion.engine.run import lock as runlock

    where = os.path.dirname(os.path.abspath(path))
    if os.path.basename(where) != "checkpoints":
        yield
        return
    lock = runlock.acquire(os.path.dirname(where), ranks=1, command="deepfusion calibrate")
    try:
        yield
    finally:
        lock.release()


def after_training(cfg, comm, summary, problem, step: int) -> None:
    """``deepfusion train``'s calibration from its final validation (``summary``: rank 0's,
    with each draw's residual): the threshold into the checkpoint of ``step`` (the run's
    lock is held by the training already). Never fails the finished training: a run whose
    draws cannot calibrate (too few, no reference solver, a residual that failed) says why
    and how to calibrate later."""
    if comm.rank != 0 or summary is None:
        return
    from deepfusion.engine.checkpoint.store import checkpoint_path
    from deepfusion.engine.predict.calibration import ERROR_LEVEL, CalibrationError

    if "residual" not in summary:   # no reference solver: an evaluation of the loss instead
        say_note(comm, f"the answer check of problem {problem.name!r} is not calibrated: "
                       f"without a reference solver there are no errors to calibrate it on")
        return
    path = checkpoint_path(cfg.run.dir, step)
    try:
        rec = store(summary, path, problem, step, ERROR_LEVEL, "deepfusion train", False)
    except (ValueError, OSError) as e:   # too few draws (data.eval_samples) is a choice
        level = "note" if isinstance(e, CalibrationError) else "WARNING"
        print(f"deepfusion: {level}: the answer check's threshold was not calibrated: {e}; "
              f"'deepfusion calibrate {cfg.run.dir} --samples N' calibrates it on N fresh "
              f"draws", file=sys.stderr, flush=True)
        return
    print(f"{summary_line(rec)} -> {path}", flush=True)
