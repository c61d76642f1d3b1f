"""``deepfusion calibrate``: the answer check's threshold of a trained checkpoint, calibrated on
fresh draws with references and written into the checkpoint; and the same at the end of
``deepfusion train`` (:func:`after_training`), from its final validation, for the metadata of
its final checkpoint, written once with it.

The rule and what is stored: :mod:`deepfusion.engine.predict.calibration` (the residual of a
5% error, read off the draws' residual-vs-error slope at a low quantile). The draws are evaluated
as ``deepfusion evaluate`` evaluates (any number of ranks, the reference solver on each draw);
rank 0 chooses the threshold and writes the checkpoint back whole, atomically and sealed,
holding the run directory's lock for the write (refused while a training job holds it).

Kept light on imports: torch is imported only after the thread layout is set (engine.layout).
"""
from __future__ import annotations

import os
from contextlib import contextmanager

from deepfusion.app.options import add_threads
from deepfusion.app.policy import collective_check, run_distributed, say_once

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
    return loaded, loaded.seed_notes(args.seed, keep_test=True)


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
                       seed=args.seed, dtype=dtype, channels_last=cl, check=True,
                       correction=loaded.correction)
    rec = collective_check(comm, store, summary, loaded.path, problem, loaded.step, args.error)
    if rec is not None:
        say_once(comm, f"{summary_line(rec)} -> {os.path.abspath(loaded.path)}", err=False)
    return 0


def summary_line(rec: dict) -> str:
    from deepfusion.engine.predict.calibration import summary_line as line

    return line(rec)


def store(summary, path: str, problem, step: int, error: float) -> dict | None:
    """Rank 0 (the one with ``summary``): the calibration of the evaluated draws, written into
    checkpoint ``path`` under the run directory's lock. ValueError (every rank refuses, by
    the caller's collective check) when the draws cannot calibrate."""
    if summary is None:
        return None
    from deepfusion.engine.predict import calibration

    rec = record_of(summary, problem, step, error, "deepfusion calibrate")
    with run_dir_lock(path):
        calibration.write(path, rec)
    return rec


def record_of(summary, problem, step: int, error: float, by: str) -> dict:
    """The calibration record of the evaluated draws ``summary`` (each draw's residual and
    error) for the checkpoint of ``step``; CalibrationError (a ValueError) when too few draws
    can calibrate."""
    from diffnet.problems import residual_kind

    from deepfusion.engine.predict import calibration

    cal = calibration.calibrate(summary["residual"], summary["rel_l2"], error=error)
    return calibration.record(cal, kind=residual_kind(problem), grid=problem.grid,
                              seed=summary["seed"], step=step, by=by)


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


def after_training(cfg, summary, problem, step: int) -> tuple[dict | None, str]:
    """``deepfusion train``'s calibration from its final validation (``summary``: rank 0's,
    with each draw's residual), for the metadata of the final checkpoint (of ``step``), which
    is written once, with it: (the record, the line that says so), or (None, the line that
    says why not and how to calibrate later). Never fails the finished training: a run whose
    draws cannot calibrate (too few, no reference solver, a residual that failed) goes on."""
    from deepfusion.engine.checkpoint.store import checkpoint_path
    from deepfusion.engine.predict.calibration import ERROR_LEVEL, CalibrationError

    if "residual" not in summary:   # no reference solver: an evaluation of the loss instead
        return None, (f"deepfusion: note: the answer check of problem {problem.name!r} is not "
                      f"calibrated: without a reference solver there are no errors to "
                      f"calibrate it on")
    try:
        rec = record_of(summary, problem, step, ERROR_LEVEL, "deepfusion train")
    except ValueError as e:   # too few draws (data.eval_samples) is a choice
        level = "note" if isinstance(e, CalibrationError) else "WARNING"
        return None, (f"deepfusion: {level}: the answer check's threshold was not calibrated: "
                      f"{e}; 'deepfusion calibrate {cfg.run.dir} --samples N' calibrates it on "
                      f"N fresh draws")
    return rec, f"{summary_line(rec)} -> {checkpoint_path(cfg.run.dir, step)}"
