"""The data-parallel training loop. Read ``Trainer.fit`` top to bottom: it is the table of
contents; every other method is one of its lines.

Multigrid schedules (``train.levels``) are a sequence of visits (:mod:`.levels`); the loop
enters the visit of the step it is about to take, which rebuilds the problem on the visit's
grid, the pool split, the inputs, the loss and a fresh optimiser; the weights carry over. A
visit that grows the network (a level with ``prolong``) has the application's ``grow`` wrap the
network so far in a larger one (:mod:`.growth`), made parallel anew; a resume or rollback
replays the growths up to its checkpoint's visit, so the weights load into the same network.
A time budget's step count is decided by the loop after its first steps (:mod:`.budget`); a
changed count re-plans the visit's schedule from the current step (:mod:`.schedule`).

Invariants: parameters are equal on every rank (broadcast by ``parallelize``, identical reduced
gradients after; checked by an all-reduced checksum every ``train.checksum_every`` steps); every
branch is decided on all-reduced or broadcast values (non-finite loss, stop signal, a checkpoint
due by time, a time budget's count, the checkpoint to resume or roll back to), so all ranks take it together and none
is left waiting in a collective. The step counter is advanced here, by the loop, and only after
a step that was taken: a failed step is never logged, checkpointed or counted.
"""
from __future__ import annotations

import os
import time
from dataclasses import replace

from deepfusion.config import config_to_dict
from deepfusion.engine.checkpoint import store as ckpt
from deepfusion.engine.run import hook, stop
from deepfusion.engine.run.resume import resume_refusal
from deepfusion.engine.parallel.data import InputCache, LazyBatch, ShardedPool
from deepfusion.engine.errors import NonFiniteLoss, ParametersDiverged, Preempted
from deepfusion.engine.predict.evaluate import eval_record, evaluate, quantity, summary_text
from deepfusion.engine.train.budget import Decision, TimeBudget
from deepfusion.engine.train.growth import Networks
from deepfusion.engine.train.plan import Visit, plan, signature, visit_at
from deepfusion.engine.train.optimizer import OptimizerSchedule
from deepfusion.engine.train.rollback import nonfinite_where, rollback_scale, stop_unless_rollback
from deepfusion.engine.train.resuming import (check_plan, elastic_note, length_change,
                                              newest_checkpoint, report_changes)
from deepfusion.engine.train.schedule import Schedule, describe_replan
from deepfusion.engine.train.stepper import lr_at
from deepfusion.engine.parallel.parallelize import ParallelModel
from deepfusion.engine.run.log import RunLog, plot_loss_curve
from deepfusion.engine.train.step import LossAndGrad, StepResult


class Trainer:
    """Fits ``model`` on the problem ``problems(grid)`` of every visit of the plan of ``cfg``
    (one visit on ``problem`` without ``train.levels``)."""

    def __init__(self, cfg, comm, problem, model: ParallelModel, *, specs: dict, dtype,
                 problems=None, grow=None):
        self.cfg, self.comm, self.model, self.dtype = cfg, comm, model, dtype
        self.specs = specs  # {"model": {...}, "problem": {...}}: rebuilds both from a checkpoint
        self.problems = problems or (lambda grid: problem)
        # grow(module, visit) -> (grown module containing it, its spec)
        self.networks = Networks(model.module, specs["model"], grow)
        self.run_dir = cfg.run.dir
        self.visits = plan(cfg)
        self.plan_signature = signature(plan(cfg, cut=False))  # checkpoints record it
        self.total_steps = self.visits[-1].end
        self.visit: Visit | None = None  # entered by the loop (enter), with everything below
        self.problem = problem
        self.pool, self.inputs, self.loss_and_grad, self.optim = None, None, None, None
        self.schedule = Schedule(0)  # the current visit's (a resume keeps or re-plans it)
        # train.time_budget: the step count is decided after the first steps (None: no budget)
        seconds = cfg.train.budget_seconds()
        self.budget = TimeBudget(seconds, cfg.train.max_steps) if seconds else None
        terms = tuple(problem.loss_term_names)
        self.step_hook = hook.load(comm.rank)  # None in a real run: tests only
        self.step, self.lr_scale = 0, 1.0
        # wall seconds of the trajectory so far, summed over the segments of a resumed run
        # (a checkpoint carries it); what error-against-time curves are drawn against
        self.elapsed_before, self.t_start = 0.0, time.perf_counter()
        self.rolled_back = ("", 0)  # (checkpoint, rollbacks to it in a row)
        self.last_save = time.perf_counter()
        self.log = RunLog(self.run_dir, rank=comm.rank, log_every=cfg.train.log_every,
                          progress=cfg.run.progress, visits=self.visits, term_names=terms,
                          known_total=self.budget is None)

    # -- the loop -------------------------------------------------------------------------------
    def fit(self, resume: bool = False, *, found=None, closing=None) -> dict:
        """Train to the end of the plan. ``found``: a list holding rank 0's read of the run
        directory (``resuming.load_newest``) by the launch's checks, which the resume takes
        out (read once, and not kept); ``closing``: see :meth:`save_final`."""
        if resume:
            self.resume(found)
        else:
            self.enter(self.visits[0])
            if self.cfg.train.on_nonfinite == "rollback":
                self.save_checkpoint()  # a rollback needs somewhere to go from the first step on
        # SIGTERM / SIGUSR1 ask for a checkpoint after the step, all ranks together (the request
        # travels in the fused allreduce); deepfusion train installs them at start-up already
        stop.install()
        t_epoch = None  # start of the current epoch, if it was run whole
        while self.step < self.total_steps:
            if self.step >= self.visit.end:
                self.end_visit()
                self.enter(visit_at(self.visits, self.step))
            epoch, s = self.visit.epoch_of(self.step)
            t_epoch = time.perf_counter() if s == 0 else t_epoch
            res = self.train_step(epoch, s)
            if not res.finite:
                self.roll_back(res)  # or stop: raises NonFiniteLoss
                t_epoch = None
                continue
            self.step += 1
            self.log_step(epoch, res)
            if self.budget is not None:
                self.budget_due(self.budget.tick(self.step))
            self.check_in_sync()
            self.maybe_checkpoint(res)
            if s == self.visit.steps_per_epoch - 1:
                self.log_epoch(epoch, t_epoch)
                self.maybe_evaluate(epoch)
        self.save_final(closing)
        self.log.close()
        if self.comm.rank == 0 and self.cfg.run.plots:
            plot_loss_curve(os.path.join(self.run_dir, "metrics.jsonl"),
                            os.path.join(self.run_dir, "loss.png"))
        return {"step": self.step}

    # -- levels ---------------------------------------------------------------------------------
    def enter(self, visit: Visit, *, fresh: bool = False):
        """Make ``visit`` current: the problem on its grid, the pool split for its batch, the
        inputs, the loss and a fresh optimiser (its schedule runs over the visit). A no-op if
        it is current already, unless ``fresh``."""
        if self.visit is not None and self.visit.index == visit.index and not fresh:
            return
        self.visit = visit
        self.reshape(visit.index)
        block = self.model.block(visit.grid)  # the whole grid, unless split over ranks
        self.problem = self.problems(visit.grid).on_block(block)
        c = self.cfg
        self.pool = ShardedPool(c.data.n_samples, visit.global_batch, self.model.data_rank,
                                self.model.data_size, seed=c.data.seed, shuffle=True)
        self.inputs = InputCache(self.problem, c.data.seed, self.dtype, block=block)
        self.loss_and_grad = LossAndGrad(self.model, self.problem, global_batch=visit.global_batch,
                                         term_names=tuple(self.problem.loss_term_names),
                                         micro_batch=visit.micro_batch,
                                         channels_last=c.model.channels_last,
                                         precision=c.train.precision,
                                         allreduce_stats=c.parallel.allreduce_stats_on(
                                             self.model.comm.size))
        self.optim = OptimizerSchedule(self.model.parameters(), visit.optim, self.loss_and_grad)
        undecided = self.budget is not None and self.budget.decision is None
        self.schedule = Schedule(0 if undecided else visit.steps)  # held until decided
        if len(self.visits) > 1:  # (step records carry level and grid: the plots read those)
            self.log.info(f"entering {visit.describe()}")

    def reshape(self, index: int):
        """Make the network the one of visit ``index`` (:class:`.growth.Networks`), made
        parallel anew if it changed."""
        grown = self.networks.at(self.visits, index)
        if grown is not None:
            module, spec = grown
            self.model = self.model.rewrap(module, self.visits[index].grid)
            self.specs = {**self.specs, "model": spec}

    def end_visit(self):
        """The validation error on the grid of the visit just finished (marks the level
        change in the error curve). Collective."""
        self.evaluate_now(self.visit.epoch_of(self.step - 1)[0])

    def progress(self) -> float:
        """The training progress a loss with a schedule (e.g. an annealed smoothing) reads:
        through the whole run, or through this visit (``train.levels[i].progress``). A function
        of the step, so every rank and a resumed run see the same loss."""
        v = self.visit
        if v.progress == "level":
            return self.schedule.progress(self.step - v.start)
        return self.schedule.progress(self.step - v.start, v.start, self.total_steps - v.end)

    # -- the step count -------------------------------------------------------------------------
    def set_length(self, d: Decision, record: bool = True):
        """Make the time budget's decided count the run's (one visit); said in metrics.jsonl
        and in every checkpoint from here."""
        self.visits = [replace(self.visits[0], steps=d.steps)]
        self.visit, self.total_steps = self.visits[0], d.steps
        self.log.set_plan(self.visits)
        if record:
            self.log.record({"kind": "time_budget", "step": self.step, **d.record()})

    def budget_due(self, due: str | None):
        """The time budget's count decided at this step, first or checked (collective: the
        same step on every rank), and the schedule re-planned to it."""
        if due is None:
            return
        decide = self.budget.decide if due == "decide" else self.budget.check
        before, d = self.total_steps, decide(self.comm, self.step, self.elapsed_before)
        self.set_length(d)
        if due == "decide" or d.steps != before:
            self.replan(d.text())
        else:
            self.log.info(f"{d.text()}: unchanged")

    def replan(self, why: str):
        """Re-plan the schedule of the current visit from this step to its (new) end,
        continuing where it stands: one log line, and a metrics record."""
        v, k = self.visit, self.step - self.visit.start
        if k >= v.steps:
            return self.log.info(f"{why}: the run ends here")
        old, self.schedule = self.schedule, self.schedule.replan(k, v.steps, v.optim.warmup_steps)
        rate = [lr_at(self.schedule.at(s), self.schedule.length, v.optim) * self.lr_scale
                for s in (k, v.steps - 1)]
        self.log.info(describe_replan(old, self.schedule, k, *rate, why))
        self.log.record({"kind": "replan", "step": self.step, "end": v.end, "lr": rate[0],
                         **self.schedule.state()})

    # -- one step -------------------------------------------------------------------------------
    def train_step(self, epoch: int, s: int) -> StepResult:
        t0 = time.perf_counter()
        v = self.visit
        if self.step_hook is not None:
            self.step_hook(self)
        stepper = self.optim.at(epoch - v.epoch_base)
        self.problem.set_progress(self.progress())
        t = self.cfg.train
        self.loss_and_grad.flags["checkpoint"] = float(self.passed(self.last_save,
                                                                   t.checkpoint_minutes))
        self.loss_and_grad.flags["stop"] = float(stop.requested())
        # this segment's training time (t_start: this process's start, or its resume)
        self.loss_and_grad.flags["time_limit"] = float(self.passed(self.t_start,
                                                                   t.time_limit_minutes))
        batch = LazyBatch(self.inputs, self.pool.local_indices(epoch, s), v.micro_batch)
        res = stepper.step(batch, step=self.schedule.at(self.step - v.start),
                           schedule_steps=self.schedule.length, lr_scale=self.lr_scale)
        res.times["step"] = time.perf_counter() - t0
        return res

    def roll_back(self, res: StepResult):
        """Reload the newest checkpoint with a lower learning rate, or stop (the rule:
        :mod:`.rollback`)."""
        where, t = nonfinite_where(res, self.step + 1), self.cfg.train
        stop_unless_rollback(t, where)
        try:
            path, state = newest_checkpoint(self.comm, self.run_dir, self.log)
        except ckpt.CheckpointError as exc:
            raise NonFiniteLoss(f"{where}, and no checkpoint to roll back to: {exc}") from None
        scale, n = rollback_scale(t, where, path, float(state["meta"]["lr_scale"]),
                                  self.rolled_back)
        failed_at = self.step + 1
        self.apply(state)
        self.lr_scale, self.rolled_back = scale, (path, n)
        self.log.truncate_after(self.step)  # metrics.jsonl keeps one trajectory
        self.log.record({"kind": "rollback", "step": self.step, "failed_at": failed_at,
                         "lr_scale": scale, "rollbacks": n})
        self.log.warn(f"{where}; rolled back to {os.path.basename(path)} (step {self.step}) "
                      f"with the learning rate scaled by {scale:g}")

    def log_step(self, epoch: int, res: StepResult):
        segment = time.perf_counter() - self.t_start  # (one reading: elapsed = before + it)
        self.log.step(self.visit, epoch, self.step, res, elapsed=self.elapsed_before + segment,
                      segment=segment)

    def log_epoch(self, epoch: int, t_epoch):
        if t_epoch is not None:  # resumed or rolled back mid-epoch: no whole-epoch time
            self.log.epoch(epoch, self.step, time.perf_counter() - t_epoch,
                           self.pool.steps_per_epoch * self.visit.global_batch)

    def maybe_evaluate(self, epoch: int):
        """Validation error every ``train.eval_every_epochs`` epochs of a visit (a metrics
        record), so users see how the error falls with training time. Collective."""
        every = self.cfg.train.eval_every_epochs
        if every <= 0 or (epoch - self.visit.epoch_base + 1) % every or self.step >= self.visit.end:
            return
        self.evaluate_now(epoch)

    def evaluate_now(self, epoch: int):
        n = self.cfg.data.eval_samples
        if n <= 0:
            return
        s = evaluate(self.model.module, self.problem, self.comm, n=n, seed=self.cfg.data.eval_seed,
                     dtype=self.dtype, channels_last=self.cfg.model.channels_last,
                     domain=self.model.domain, correction=self.cfg.problem.correction)
        if s is not None:
            v = self.visit
            self.log.record({"kind": "eval", "epoch": epoch, "step": self.step, "level": v.level,
                             "grid": list(v.grid), "elapsed_s": self.elapsed(),
                             **eval_record(s)})
            grid = "x".join(map(str, v.grid))
            self.log.info(f"eval at step {self.step} ({grid}): validation "
                          f"{quantity(s, short=True)} {summary_text(s)}")

    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.t_start

    def check_in_sync(self):
        every = self.cfg.train.checksum_every
        if every <= 0 or self.step % every:
            return
        hi, lo = self.model.checksum()
        if hi != lo:
            raise ParametersDiverged(f"parameters differ across ranks at step {self.step} "
                                     f"(checksums {lo!r} .. {hi!r}); this is a bug, please report it")

    # -- checkpoints ----------------------------------------------------------------------------
    def passed(self, since: float, minutes: float) -> bool:
        """Rank 0's clock: ``minutes`` (0 = never) since ``since`` (``time.perf_counter``). The
        answer travels in the step's fused allreduce, so every rank acts at the same step."""
        return (self.comm.rank == 0 and minutes > 0
                and time.perf_counter() - since >= 60.0 * minutes)

    def maybe_checkpoint(self, res: StepResult):
        why = stop.reason(res.flags, self.cfg.train.time_limit_minutes)
        if why:
            self.save_checkpoint()
            raise Preempted(f"{why}: checkpoint written at step {self.step}; "
                            f"resume with --resume {self.run_dir}")
        every = self.cfg.train.checkpoint_every
        due = (every > 0 and self.step % every == 0) or res.flags["checkpoint"] > 0
        if due and self.step < self.total_steps:
            self.save_checkpoint()

    def save_final(self, closing):
        """The final checkpoint, written once: ``closing(trainer)`` (the final validation,
        collective) runs first and returns what its metadata adds (rank 0's; the answer check's
        calibration). What is saved is the state before it (metadata, RNG), as if saved first,
        so training on from it continues the same trajectory; if it fails, that state is saved
        all the same (by rank 0 alone: the others may be waiting in one of its collectives)."""
        meta, rng = self.meta(), ckpt.capture_rng_state()
        try:
            extra = closing(self) if closing is not None else None
        except Exception:
            self.write_checkpoint(meta, rng)
            raise
        self.write_checkpoint({**meta, **(extra or {})}, rng)
        self.comm.barrier()

    def save_checkpoint(self):
        self.write_checkpoint(self.meta(), ckpt.capture_rng_state())
        self.comm.barrier()  # nobody runs ahead of a checkpoint that may be needed for rollback
        self.last_save = time.perf_counter()

    def write_checkpoint(self, meta: dict, rng: dict):
        """Rank 0 writes this step's checkpoint (no collective)."""
        if self.comm.rank == 0:
            ckpt.save_checkpoint(ckpt.checkpoint_path(self.run_dir, self.step),
                                 model_state=self.model.module.state_dict(),
                                 optim_state=self.optim.current.state_dict(), rng_state=rng,
                                 meta=meta)
            ckpt.prune_checkpoints(self.run_dir, self.cfg.train.keep_checkpoints)

    def meta(self) -> dict:
        v = self.visit
        decided = self.budget.decision if self.budget is not None else None
        return {"step": self.step, "lr_scale": self.lr_scale, "world_size": self.comm.size,
                **self.schedule.state(), "optimizer": self.optim.current.name,
                "time_budget": decided.record() if decided is not None else None,
                "visit": v.index, "level": v.level, "grid": list(v.grid),
                "elapsed_s": self.elapsed(),
                "plan": self.plan_signature, "run_id": self.log.run_id,
                "config": config_to_dict(self.cfg), **self.specs}

    def apply(self, state: dict):
        """Restore weights, step, the visit of the step, its optimiser (the stepper that wrote
        it; a fresh one if the checkpoint closed the previous visit), RNG and rate scale."""
        meta = state["meta"]
        self.reshape(int(meta["visit"]))
        self.model.module.load_state_dict(state["model_state"])
        self.step = int(meta["step"])
        visit = visit_at(self.visits, self.step)
        if int(meta["visit"]) == visit.index:
            self.enter(visit)
            epoch = visit.epoch_of(self.step)[0] - visit.epoch_base
            self.optim.restore(meta["optimizer"] or self.optim.name_at(epoch),
                               state["optim_state"])
        else:  # written at the end of the previous visit: this one starts with a fresh optimiser
            self.enter(visit, fresh=True)
        ckpt.restore_rng_state(state["rng_state"])
        self.lr_scale = float(meta["lr_scale"])

    def resume(self, found=None):
        try:
            path, state = newest_checkpoint(self.comm, self.run_dir, self.log, found)
        except ckpt.CheckpointError as exc:  # raised on every rank alike: bad input, exit 2
            raise resume_refusal(self.run_dir, exc) from None
        meta = state["meta"]
        check_plan(self.cfg, self.plan_signature, meta, self.log)
        self.apply(state)
        self.log.truncate_after(self.step)
        # the trajectory's time: the segments before this one, up to the checkpoint (a rollback
        # keeps counting instead: its lost steps took time in this segment)
        self.elapsed_before, self.t_start = float(meta["elapsed_s"]), time.perf_counter()
        if meta["world_size"] != self.comm.size:
            self.log.info(elastic_note(meta["world_size"], self.comm.size))
        self.log.info(f"resumed from {path} at step {self.step}")
        self.continue_plan(meta)
        report_changes(self.cfg, meta["config"], self.step, self.log)

    def continue_plan(self, meta: dict):
        """The checkpoint's step count and schedule, unless the count changed (train.max_steps,
        train.epochs, the time budget), which re-plans the schedule from here. A budget not yet
        decided is decided in this process; the schedule is kept as it is until then."""
        same = int(meta["visit"]) == self.visit.index  # (else: this visit starts afresh)
        if same:
            self.schedule = Schedule.from_state(meta, self.schedule.length)
        why = length_change(self.cfg, meta)
        if self.budget is not None:
            d, changed = self.budget.resumed(Decision.from_record(meta.get("time_budget")),
                                             self.step, self.elapsed_before)
            if d is None:
                return
            self.set_length(d, record=bool(changed))
            why = f"{changed}: {d.text()}" if changed else why
        if same and self.schedule.end != self.visit.steps:
            self.replan(why)

