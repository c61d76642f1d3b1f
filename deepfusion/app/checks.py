"""What tools outside the application (``deepfusion.jobs``: job scripts, scaling sweeps, time
to accuracy) may ask of ``train`` without training: ``train``'s own start-up checks and
``deepfusion check``'s probe, under names that stay while the modules behind them change.

* :func:`check_launch`: every start-up check of ``train`` for a launch on P ranks elsewhere (a
  job: this host's CPU, lock and run directory are not the job's); InputError or ValueError
  with the message ``train`` would print.
* :func:`check_run_dir`, :func:`check_resumable` and :func:`check_lock`: a run directory as a
  job will start on it.
* :func:`level_plan`: the visits of a config's plan (grid, global batch, steps, optimiser and
  growth of each).
* :func:`problem_channels`: the input and output channels of a config's problem.
* :func:`probe`: seconds per step and peak memory of each level, measured in a child process.
* :func:`check_output` and :func:`check_output_dir`: where a tool may write its ``--out``
  (never onto its inputs, a run's checkpoints or the files a run keeps).

Nothing here imports torch until it is needed (:func:`problem_channels` and :func:`probe`).
"""
from __future__ import annotations

from deepfusion.app import check, outputs, preflight
from deepfusion.app.probe import run_probe
from deepfusion.engine.train.plan import plan


def check_launch(config, sets, ranks: int):
    """``train``'s start-up on ``ranks`` ranks of another host (no probe): the checked config
    (``.cfg``) and the warnings to show (``.warnings``)."""
    return check.check_launch(config, sets, ranks, here=False)


def check_run_dir(run_dir: str, resume: bool) -> None:
    """ValueError with ``train``'s message if ``run_dir`` holds a run and ``resume`` is false,
    or holds none and it is true."""
    preflight.check_run_dir(run_dir, resume, False)


def check_resumable(run_dir: str) -> str:
    """The checkpoint ``train --resume run_dir`` would start from, or InputError with
    ``train``'s message when none of the run's checkpoints loads (all damaged, or none)."""
    return preflight.check_resumable(run_dir)


def check_lock(run_dir: str, ranks: int) -> str:
    """What ``train`` on ``ranks`` ranks would find in the run directory's lock: an error while
    a live job holds it, a note when a stale one would be taken over, else ""."""
    return preflight.check_lock(run_dir, ranks)


def level_plan(cfg) -> list:
    """The visits of the config's plan, in the order ``train`` takes them. A time budget's
    step count is the run's own decision: refused, naming the setting to give instead."""
    if cfg.train.time_budget.strip():
        raise ValueError(f"train.time_budget = {cfg.train.time_budget!r}: the run decides its "
                         f"step count from its own step time, so there is no plan to project; "
                         f"give the steps instead (--set train.time_budget='' --set "
                         f"train.max_steps=N)")
    return plan(cfg)


def problem_channels(cfg, grid) -> tuple[int, int]:
    """(input channels, output channels) of the config's problem on ``grid``."""
    from deepfusion.app.build import build_problem  # torch: only when asked

    problem = build_problem(cfg, grid)
    return len(problem.input_channels), problem.output_channels


def probe(cfg, ranks: int, threads: int) -> dict:
    """``deepfusion check``'s probe of ``cfg`` on ``ranks`` ranks of ``threads`` threads:
    ``{"levels": [{"level", "median_step_s", "local_batch", ...}]}``; ValueError if it failed."""
    return run_probe(cfg, ranks, threads)


def check_output(path: str, *, flag: str, inputs=()) -> None:
    """ValueError naming ``flag`` unless ``path`` is a file the tool may write (its directory
    exists and is writable; not a directory, one of ``inputs`` or a run's own file)."""
    outputs.check_output(path, flag=flag, inputs=inputs)


def check_output_dir(path: str, *, flag: str, create: bool = True) -> None:
    """ValueError naming ``flag`` unless ``path`` is a directory the tool may write into (or,
    with ``create``, make); never a run's checkpoints directory."""
    outputs.check_output_dir(path, flag=flag, create=create)
