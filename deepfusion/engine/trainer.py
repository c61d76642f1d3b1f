"""The data-parallel training loop. Read ``Trainer.fit`` top to bottom: it is the table of
contents; every other method is one of its lines.

Invariants: parameters are equal on every rank (broadcast by ``parallelize``, identical reduced
gradients after; checked by an all-reduced checksum every ``train.checksum_every`` steps); every
branch is decided on all-reduced or broadcast values (non-finite loss, stop signal, a checkpoint
due by time, the checkpoint to resume or roll back to), so all ranks take it together and none
is left waiting in a collective. The step counter is advanced here, by the loop, and only after
a step that was taken: a failed step is never logged, checkpointed or counted.
"""
from __future__ import annotations

import os
import signal
import time

from ..config import config_to_dict
from . import checkpoint as ckpt
from .data import InputCache, LazyBatch, ShardedPool
from .errors import InputError, NonFiniteLoss, ParametersDiverged, Preempted
from .evaluate import evaluate, summary_text
from .faults import Faults
from .optimizers import OptimizerSchedule
from .parallel import ParallelModel
from .runlog import RunLog, plot_loss_curve
from .step import LossAndGrad, StepResult


def planned_steps(cfg, steps_per_epoch: int) -> int:
    """Steps of the run: ``train.epochs`` epochs, capped by ``train.max_steps`` if set."""
    total = cfg.train.epochs * steps_per_epoch
    return min(total, cfg.train.max_steps) if cfg.train.max_steps > 0 else total


class Trainer:
    def __init__(self, cfg, comm, task, model: ParallelModel, *, specs: dict, dtype):
        self.cfg, self.comm, self.task, self.model, self.dtype = cfg, comm, task, model, dtype
        self.specs = specs  # {"model": {...}, "problem": {...}}: rebuilds both from a checkpoint
        self.run_dir = cfg.run.dir
        self.pool = ShardedPool(cfg.data.n_samples, cfg.data.global_batch, comm.rank, comm.size,
                                seed=cfg.data.seed, shuffle=True)
        self.total_steps = planned_steps(cfg, self.pool.steps_per_epoch)
        self.schedule_steps = self.total_steps  # a resumed run keeps its original schedule
        self.inputs = InputCache(task, cfg.data.seed, dtype)
        terms = tuple(task.loss_term_names)
        self.loss_and_grad = LossAndGrad(model, task, global_batch=cfg.data.global_batch,
                                         term_names=terms, micro_batch=cfg.train.micro_batch,
                                         channels_last=cfg.model.channels_last,
                                         precision=cfg.train.precision)
        self.optim = OptimizerSchedule(model.parameters(), cfg.optim, self.loss_and_grad)
        self.faults = Faults.from_env(comm.rank)
        self.step, self.lr_scale = 0, 1.0
        self.rolled_back = ("", 0)  # (checkpoint, rollbacks to it in a row)
        self.last_save = time.monotonic()
        self.log = RunLog(self.run_dir, rank=comm.rank, log_every=cfg.train.log_every,
                          progress=cfg.run.progress, total_steps=self.total_steps,
                          term_names=terms)

    # -- the loop -------------------------------------------------------------------------------
    def fit(self, resume: bool = False) -> dict:
        if resume:
            self.resume()
        elif self.cfg.train.on_nonfinite == "rollback":
            self.save_checkpoint()  # a rollback needs somewhere to go from the first step on
        self.install_signal_handlers()
        spe = self.pool.steps_per_epoch
        t_epoch = None  # start of the current epoch, if it was run whole
        while self.step < self.total_steps:
            epoch, s = divmod(self.step, spe)
            t_epoch = time.perf_counter() if s == 0 else t_epoch
            res = self.train_step(epoch, s)
            if not res.finite:
                self.roll_back(res)  # or stop: raises NonFiniteLoss
                t_epoch = None
                continue
            self.step += 1
            self.log_step(epoch, res)
            self.check_in_sync()
            self.maybe_checkpoint(res)
            if s == spe - 1:
                self.log_epoch(epoch, t_epoch)
                self.maybe_evaluate(epoch)
        self.save_checkpoint()
        self.log.close()
        if self.comm.rank == 0:
            plot_loss_curve(os.path.join(self.run_dir, "metrics.jsonl"),
                            os.path.join(self.run_dir, "loss.png"))
        return {"step": self.step}

    # -- one step -------------------------------------------------------------------------------
    def train_step(self, epoch: int, s: int) -> StepResult:
        t0 = time.perf_counter()
        self.loss_and_grad.poison_next = self.faults.fire(self.step)
        stepper = self.optim.at(epoch)
        # a loss with a schedule (e.g. an annealed smoothing) reads the progress: a function of
        # the step, so every rank and a resumed run see the same loss
        self.task.set_progress(self.step / self.schedule_steps)
        self.loss_and_grad.flags["checkpoint"] = float(self.checkpoint_due())
        batch = LazyBatch(self.inputs, self.pool.local_indices(epoch, s), self.cfg.train.micro_batch)
        res = stepper.step(batch, step=self.step, schedule_steps=self.schedule_steps,
                           lr_scale=self.lr_scale)
        res.times["step"] = time.perf_counter() - t0
        return res

    def roll_back(self, res: StepResult):
        """Reload the newest checkpoint with a lower learning rate, or stop. Rollbacks to the
        same checkpoint in a row lower it further (factor^k), until the floor."""
        what = ", ".join(res.nonfinite_terms) if res.nonfinite_terms else "the gradient (grad_norm)"
        where = f"non-finite loss at step {self.step + 1}: term(s) {what}"
        fix = ("Lower optim.lr, set optim.grad_clip, or set train.on_nonfinite = \"rollback\" "
               "to restart from the last checkpoint.")
        t = self.cfg.train
        if t.on_nonfinite != "rollback":
            raise NonFiniteLoss(f"{where}. {fix}")
        try:
            path, state = self.load_newest()
        except ckpt.CheckpointError as exc:
            raise NonFiniteLoss(f"{where}, and no checkpoint to roll back to: {exc}") from None
        n = self.rolled_back[1] + 1 if self.rolled_back[0] == path else 1
        scale = float(state["meta"].get("lr_scale", 1.0)) * t.rollback_lr_factor ** n
        name = os.path.basename(path)
        if scale < t.rollback_min_lr_scale:
            raise NonFiniteLoss(
                f"{where}; still failing after {n - 1} rollback(s) to {name} (learning-rate "
                f"scale {scale / t.rollback_lr_factor:g}, floor train.rollback_min_lr_scale = "
                f"{t.rollback_min_lr_scale:g}). Lower optim.lr or set optim.grad_clip.")
        failed_at = self.step + 1
        self.apply(state)
        self.lr_scale, self.rolled_back = scale, (path, n)
        self.log.truncate_after(self.step)  # metrics.jsonl keeps one trajectory
        self.log.record({"kind": "rollback", "step": self.step, "failed_at": failed_at,
                         "lr_scale": scale, "rollbacks": n})
        self.log.warn(f"{where}; rolled back to {name} (step {self.step}) with the learning "
                      f"rate scaled by {scale:g}")

    def log_step(self, epoch: int, res: StepResult):
        t = res.times
        bs = self.cfg.data.global_batch
        self.log.step({"kind": "step", "step": self.step, "epoch": epoch, "loss": res.loss,
                       **res.terms, "terms": res.terms, "grad_norm": res.grad_norm, "lr": res.lr,
                       **{f"time_{k}": v for k, v in t.items()},
                       "samples_per_s": bs / t["step"] if t["step"] > 0 else 0.0, **res.metrics})

    def log_epoch(self, epoch: int, t_epoch):
        if t_epoch is None:  # resumed or rolled back mid-epoch: no whole-epoch time to report
            return
        dt = time.perf_counter() - t_epoch
        n = self.pool.steps_per_epoch * self.cfg.data.global_batch
        self.log.record({"kind": "epoch", "epoch": epoch, "step": self.step, "time_epoch": dt,
                         "samples_per_s": n / dt})

    def maybe_evaluate(self, epoch: int):
        """Validation error every ``train.eval_every_epochs`` epochs (a metrics record), so users
        see how the error falls with training time. Collective: every rank calls it."""
        every, n = self.cfg.train.eval_every_epochs, self.cfg.data.eval_samples
        if every <= 0 or n <= 0 or (epoch + 1) % every or self.step >= self.total_steps:
            return
        s = evaluate(self.model.module, self.task, self.comm, n=n, seed=self.cfg.data.eval_seed,
                     dtype=self.dtype, channels_last=self.cfg.model.channels_last)
        if s is not None:
            self.log.record({"kind": "eval", "epoch": epoch, "step": self.step,
                             **{k: s[k] for k in ("rel_l2_mean", "rel_l2_median", "rel_l2_max")}})
            self.log.info(f"eval at epoch {epoch + 1}: validation rel L2 {summary_text(s)}")

    def check_in_sync(self):
        every = self.cfg.train.checksum_every
        if every <= 0 or self.step % every:
            return
        hi, lo = self.model.checksum()
        if hi != lo:
            raise ParametersDiverged(f"parameters differ across ranks at step {self.step} "
                                     f"(checksums {lo!r} .. {hi!r}); this is a bug, please report it")

    # -- checkpoints ----------------------------------------------------------------------------
    def checkpoint_due(self) -> bool:
        """Rank 0's clock: ``train.checkpoint_minutes`` since the last checkpoint. The answer
        travels in the step's fused allreduce, so every rank saves at the same step."""
        minutes = self.cfg.train.checkpoint_minutes
        return (self.comm.rank == 0 and minutes > 0
                and time.monotonic() - self.last_save >= 60.0 * minutes)

    def maybe_checkpoint(self, res: StepResult):
        if res.flags["stop"] > 0:
            self.save_checkpoint()
            raise Preempted(f"stop signal received: checkpoint written at step {self.step}; "
                            f"resume with --resume {self.run_dir}")
        every = self.cfg.train.checkpoint_every
        due = (every > 0 and self.step % every == 0) or res.flags["checkpoint"] > 0
        if due and self.step < self.total_steps:
            self.save_checkpoint()

    def save_checkpoint(self):
        if self.comm.rank == 0:
            path = ckpt.checkpoint_path(self.run_dir, self.step)
            ckpt.save_checkpoint(path, model_state=self.model.module.state_dict(),
                                 optim_state=self.optim.current.state_dict(),
                                 rng_state=ckpt.capture_rng_state(), meta=self.meta())
            ckpt.prune_checkpoints(self.run_dir, self.cfg.train.keep_checkpoints)
        self.comm.barrier()  # nobody runs ahead of a checkpoint that may be needed for rollback
        self.last_save = time.monotonic()

    def meta(self) -> dict:
        return {"step": self.step, "lr_scale": self.lr_scale, "world_size": self.comm.size,
                "schedule_steps": self.schedule_steps, "optimizer": self.optim.current.name,
                "config": config_to_dict(self.cfg), **self.specs}

    def load_newest(self) -> tuple[str, dict]:
        """The newest loadable checkpoint, found and read by rank 0 only and broadcast, so every
        rank restores the same state and a file system decision is taken once."""
        found = error = None
        if self.comm.rank == 0:
            try:
                path, state, skipped = ckpt.load_latest(self.run_dir)
                for why in skipped:
                    self.log.warn(f"skipped checkpoint {why}; using {os.path.basename(path)}")
                found = (path, state)
            except ckpt.CheckpointError as exc:
                error = str(exc)
        found, error = self.comm.bcast_obj((found, error))
        if error is not None:
            raise ckpt.CheckpointError(error)
        return found

    def apply(self, state: dict):
        """Restore weights, optimiser (the stepper that wrote it), RNG, step and rate scale."""
        meta = state["meta"]
        self.model.module.load_state_dict(state["model_state"])
        self.step = int(meta["step"])
        name = meta.get("optimizer") or self.optim.name_at(self.step // self.pool.steps_per_epoch)
        self.optim.restore(name, state["optim_state"])
        ckpt.restore_rng_state(state["rng_state"])
        self.lr_scale = float(meta.get("lr_scale", 1.0))

    def resume(self):
        try:
            path, state = self.load_newest()
        except ckpt.CheckpointError as exc:  # raised on every rank alike: bad input, exit 2
            raise InputError(f"--resume {self.run_dir}: {exc}; start without --resume") from None
        self.apply(state)
        meta = state["meta"]
        old = meta.get("world_size")
        if old is not None and old != self.comm.size:
            self.log.info(f"elastic resume: checkpoint written on P = {old} ranks, continuing on "
                          f"P = {self.comm.size}; the data order and the global batch are "
                          f"unchanged, so the run continues the same trajectory")
        planned = int(meta.get("schedule_steps", self.total_steps))
        if planned != self.total_steps:
            self.log.info(f"note: train.epochs / train.max_steps now end the run at step "
                          f"{self.total_steps}; the learning-rate schedule keeps the original "
                          f"run's length of {planned} steps")
        self.schedule_steps = planned
        self.log.truncate_after(self.step)
        self.log.info(f"resumed from {path} at step {self.step}")

    # -- signals --------------------------------------------------------------------------------
    def install_signal_handlers(self):
        """SIGTERM / SIGUSR1 (SLURM's time-limit warning) ask for a checkpoint at the end of the
        current step; the request travels in the fused allreduce so all ranks stop together."""
        def handler(signum, frame):
            self.loss_and_grad.flags["stop"] = 1.0

        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, handler)
