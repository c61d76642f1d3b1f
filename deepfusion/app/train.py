"""``deepfusion train``, ``deepfusion demo`` and ``deepfusion config``: a run from a config, on
any number of ranks, its validation error, and the config it resolves to.

``train`` reads like its steps: load and check everything (:mod:`.build`), set the threads,
create the run directory, make the model parallel, fit, and report the validation error.
"""
from __future__ import annotations

import os
import sys
from dataclasses import replace

from deepfusion.config import load_config
from deepfusion.engine.run import hangup, lock as runlock
from deepfusion.engine.parallel.layout import agreed_precision, precision_line, report, setup_threads
from deepfusion.engine.parallel.memory import reuse_freed_memory
from deepfusion.app.agreement import check_same_config
from deepfusion.app.policy import ExitCode, collective_check, run_distributed, say_note, say_once
from deepfusion.app.preflight import apply_resume, check_run, useful_ranks_warning


def register(sub) -> None:
    t = sub.add_parser("train", help="train a DiffNet generator (any number of MPI ranks)")
    t.add_argument("config", nargs="?", default=None,
                   help="TOML config (keys not in it take their defaults; problem.name has none; "
                        "with --resume, RUN_DIR/config.toml is read if no config is given)")
    t.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config key, VALUE in TOML, e.g. train.max_steps=100 or "
                        "problem.options.c_range=[3, 6] (repeatable; 'deepfusion config' lists "
                        "the keys)")
    t.add_argument("--resume", metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its newest complete checkpoint (on any "
                        "number of ranks that divides data.global_batch)")
    t.add_argument("--overwrite", action="store_true", help="replace an existing run in run.dir")
    t.set_defaults(run=run_train)


def run_train(args) -> int:
    """The stop-signal handler first (a signal during start-up is kept for the first step),
    then the command on every rank."""
    from deepfusion.engine.run import stop

    try:
        stop.install()
    except ValueError as e:  # a malformed DEEPFUSION_STOP_DEADLINE / _START_TIMEOUT
        print(f"deepfusion: error: {e}", file=sys.stderr, flush=True)
        return ExitCode.INPUT
    return run_distributed(cmd_train, args)


def cmd_train(args, comm) -> int:
    collective_check(comm, apply_resume, args)  # requeued jobs: the run dir holds its config
    cfg = collective_check(comm, load_config, args.config, args.set or [])
    check_same_config(comm, cfg)  # an MPMD launch or a file that differs between nodes
    # One live job per run directory: rank 0 holds its lock from before the directory is
    # looked at until the last file is written (released on every way out)
    lock = collective_check(comm, lock_run_dir, cfg, comm, " ".join(sys.argv[1:]))
    with runlock.held(lock, comm, on_lost=lambda why: lost_lock(why, comm)):
        return train_locked(args, comm, cfg)


def lock_run_dir(cfg, comm, command: str):
    """Rank 0 takes the run directory's lock (refused while a live job holds it; a stale one
    is taken over, with a warning); None on the other ranks."""
    if comm.rank != 0:
        return None
    lock = runlock.acquire(cfg.run.dir, ranks=comm.size, command=f"deepfusion {command}")
    if lock.note:
        print(f"warning: run directory {cfg.run.dir}: {lock.note}", file=sys.stderr, flush=True)
    return lock


def lost_lock(why: str, comm) -> None:
    """Another job took the lock, having judged this one dead: end every rank at once, so the
    two never interleave (from the heartbeat thread)."""
    print(f"deepfusion: error: lost the lock of the run directory: {why}. Ending this job "
          f"without writing more.", file=sys.stderr, flush=True)
    comm.abort(ExitCode.ABORT)


def train_locked(args, comm, cfg) -> int:
    """The run, under the run directory's lock."""
    # Ranks, CPU and run directory first: a refused launch exits before any rank imports torch.
    collective_check(comm, check_run, cfg, comm.size, bool(args.resume), args.overwrite)
    past = useful_ranks_warning(cfg, comm.size)  # the line 'deepfusion check' prints
    if past:
        say_once(comm, f"deepfusion: warning: {past}")
    if comm.rank == 0:  # a closed terminal would kill the launcher: said before any work
        say_note(comm, hangup.note(sys.argv, comm.size))
    compile_cache_env(cfg)  # before torch compiles anything
    layout, _node = setup_threads(comm, cfg.parallel.threads_per_rank)  # before torch is imported
    say_note(comm, reuse_freed_memory(cfg.parallel.reuses_memory()))
    precision = agreed_precision(cfg.train.precision, comm)
    # torch comes in with these: after the thread layout is set (OpenMP reads it once)
    from deepfusion.engine.parallel.parallelize import parallelize
    from deepfusion.engine.train.trainer import Trainer
    from deepfusion.app.build import (build_checked, check_resume, first_grid, fused_kernels_hint,
                                      model_grower, prepare_run_dir, torch_dtype)

    layouts = comm.gather_obj(layout)
    if layouts is not None:  # rank 0 prints the layout
        text, warns = report(layouts, comm.library_version())
        print(text, flush=True)
        print(precision_line(precision, requested=cfg.train.precision), flush=True)
        for w in warns:
            print(f"warning: {w}", file=sys.stderr, flush=True)
    problem, model, specs, problems = build_checked(cfg, on_every_rank(comm))
    if cfg.train.fused_kernels:
        from diffnet.kernels import counts, summary

        say_once(comm, f"fused kernels: {summary(model)}" + (
            "" if any(counts(model).values()) else "; this network has none of them, so "
                                                   "train.fused_kernels changes nothing"),
                 err=False)
    elif hint := fused_kernels_hint(cfg, model, precision):
        say_once(comm, hint, err=False)
    if not args.resume:  # a known trap of this problem with this network, said once
        from deepfusion.app.traps import instance_norm_warning

        trap = collective_check(comm, instance_norm_warning, cfg, problems(first_grid(cfg)),
                                model, comm.rank)
        if trap:
            say_once(comm, f"deepfusion: warning: {trap}")
    found = []  # rank 0's read of the checkpoint to resume from, which the trainer takes
    if args.resume:  # this run's checkpoint, this network: before anything is written
        found.append(collective_check(comm, check_resume, cfg, model, comm.rank))
    collective_check(comm, prepare_run_dir, cfg, bool(args.resume), args.overwrite, comm.rank)

    pmodel = parallelize(model, comm, cfg.parallel, compile=cfg.train.compile,
                         grid=first_grid(cfg))
    if pmodel.domain is not None:
        d = pmodel.domain
        say_once(comm, f"domain split {list(d.split)}: {d.groups} data-parallel group(s) of "
                       f"{d.comm.size} ranks, blocks of {'x'.join(map(str, d.block.shape))} "
                       f"nodes on the {'x'.join(map(str, d.block.grid))} grid", err=False)
    # The run directory's config keeps "auto" (a requeue on other nodes chooses again); the
    # checkpoints record what ran, so a resume that computes otherwise names the change.
    run_cfg = replace(cfg, train=replace(cfg.train, precision=precision))
    trainer = Trainer(run_cfg, comm, problem, pmodel, specs=specs, dtype=torch_dtype(cfg),
                      problems=problems, grow=model_grower(cfg, problem))
    final = FinalValidation(cfg, comm) if cfg.data.eval_samples > 0 else None
    trainer.fit(resume=bool(args.resume), found=found, closing=final)
    if final is not None:
        final.report()
    return 0


class FinalValidation:
    """The validation draw on the grid the network last trained on (the problem and block of
    the trainer's last visit: problem.grid, unless train.max_steps cut a multigrid plan before
    its last level, which is then said). Run by the trainer before its final checkpoint
    (``closing``), whose metadata gets the answer check's calibration from these draws, so
    that checkpoint is written once; said, and written to eval.json by rank 0 (with the step,
    level and grid), once it is (:meth:`report`)."""

    def __init__(self, cfg, comm):
        self.cfg, self.comm = cfg, comm
        self.summary = self.problem = self.calibration = None
        self.said = ""

    def __call__(self, trainer) -> dict | None:
        """Evaluate (collective); rank 0's metadata for the final checkpoint."""
        from deepfusion.engine.predict.calibration import KEY
        from deepfusion.engine.predict.evaluate import evaluate
        from deepfusion.app.build import torch_dtype
        from deepfusion.app.calibrate import after_training

        cfg, pmodel, visit = self.cfg, trainer.model, trainer.visit  # (grown, if prolonged)
        # with each draw's answer residual: what calibrates the model's answer check
        summary = evaluate(pmodel.module, trainer.problem, self.comm, n=cfg.data.eval_samples,
                           seed=cfg.data.eval_seed, dtype=torch_dtype(cfg),
                           channels_last=cfg.model.channels_last, domain=pmodel.domain,
                           check=True, correction=cfg.problem.correction)
        if summary is None:
            return None
        summary.update(step=trainer.step, level=visit.level, grid=list(visit.grid))
        self.summary, self.problem = summary, trainer.problem
        self.calibration, self.said = after_training(cfg, summary, trainer.problem, trainer.step)
        return {KEY: self.calibration} if self.calibration is not None else None

    def report(self) -> None:
        """eval.json, the validation line and the calibration's (rank 0)."""
        from deepfusion.engine.predict.evaluate import quantity, summary_text, write_report
        from deepfusion.engine.predict.loader import grid_text

        cfg, summary = self.cfg, self.summary
        if summary is None:
            return
        write_report(summary, cfg.run.dir, self.problem.axes, plot=cfg.run.plots)
        grid = summary["grid"]
        if grid != list(cfg.problem.grid):
            print(f"deepfusion: note: train.max_steps = {cfg.train.max_steps} ended the "
                  f"plan in level {summary['level']}: validated on {grid_text(grid)}, the last "
                  f"grid trained, not problem.grid {grid_text(cfg.problem.grid)}",
                  file=sys.stderr, flush=True)
        print(f"validation {quantity(summary)} over {summary['n']} draws (data.eval_seed) on "
              f"{grid_text(grid)} at step {summary['step']}: {summary_text(summary)} -> "
              f"{os.path.join(cfg.run.dir, 'eval.json')}", flush=True)
        print(self.said, file=sys.stdout if self.calibration else sys.stderr, flush=True)


def on_every_rank(comm):
    """``build_checked``'s ``check`` for a real launch: each step under collective_check."""
    def check(fn, *args, per_rank=False):
        return collective_check(comm, fn, *args, *([comm.rank] if per_rank else []))
    return check


def compile_cache_env(cfg):
    """TorchInductor's kernel cache: train.compile_cache if set, else a TORCHINDUCTOR_CACHE_DIR
    the user exported, else RUN_DIR/compile_cache (so a requeued job does not compile again).
    Set before anything compiles: inductor reads the variable once."""
    if not cfg.train.compile:
        return
    if cfg.train.compile_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(cfg.train.compile_cache)
    else:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                              os.path.abspath(os.path.join(cfg.run.dir, "compile_cache")))
