"""The data-parallel training loop. Read ``Trainer.fit`` top to bottom: it is the table of
contents; every other method is one of its lines.

Invariants: parameters are equal on every rank (broadcast at start, identical reduced
gradients after; checked by an all-reduced checksum every ``train.checksum_every`` steps);
every branch (non-finite loss, stop on signal) is decided on all-reduced values, so all ranks
take it together and none is left waiting in a collective.
"""
from __future__ import annotations

import os
import signal
import time

import torch

from . import checkpoint as ckpt
from . import lbfgs  # L-BFGS (deepfusion/lbfgs.py)
from .data import InputCache, ShardedPool
from .gradsync import GradSync
from .optim import lr_at, set_lr
from .runlog import RunLog, plot_loss_curve
from .step import LossAndGrad, broadcast_module, parameter_checksum

PREEMPTED_EXIT = 99  # checkpoint written on SIGTERM/SIGUSR1: requeue and --resume


class NonFiniteLoss(RuntimeError):
    """Raised on every rank together when the global loss or gradient is not finite."""


class ParametersDiverged(RuntimeError):
    """Raised on every rank together when ranks' parameters differ."""


class Preempted(Exception):
    """Raised on every rank together after the checkpoint written on a stop signal."""


class InjectedFailure(RuntimeError):
    """The test hook train.fail_at_step: an exception on one rank only."""


class Trainer:
    def __init__(self, cfg, comm, task, model, *, specs: dict, log_every=None):
        self.cfg, self.comm, self.task, self.model = cfg, comm, task, model
        self.specs = specs  # {"model": {...}, "problem": {...}}: rebuilds both from a checkpoint
        self.run_dir = cfg.run.dir
        self.dtype = torch.float64 if cfg.train.dtype == "float64" else torch.float32
        self.pool = ShardedPool(cfg.data.n_samples, cfg.data.global_batch, comm.rank, comm.size,
                                seed=cfg.data.seed, shuffle=True)
        self.total_steps = cfg.train.epochs * self.pool.steps_per_epoch
        if cfg.train.max_steps > 0:
            self.total_steps = min(self.total_steps, cfg.train.max_steps)
        self.inputs = InputCache(task, cfg.data.seed, self.dtype)
        self.term_names = ("pde", "bc")
        broadcast_module(model, comm)
        self.gs = GradSync(model, comm, bucket_mb=cfg.parallel.bucket_mb, overlap=cfg.parallel.overlap)
        # --- L-BFGS (deepfusion/lbfgs.py): adam/sgd, or L-BFGS if optim.name = "lbfgs" ---
        self.optimizer = lbfgs.build(model.parameters(), cfg.optim, epoch=0)
        self._lbfgs_stepper = None
        # --- end L-BFGS ---
        self.loss_and_grad = LossAndGrad(model, task, comm, self.gs, global_batch=cfg.data.global_batch,
                                         term_names=self.term_names, micro_batch=cfg.train.micro_batch,
                                         channels_last=cfg.model.channels_last,
                                         precision=cfg.train.precision,
                                         forward=compiled(model, cfg) if cfg.train.compile else None)
        self.step, self.lr_scale = 0, 1.0
        self.log = RunLog(self.run_dir, rank=comm.rank, log_every=cfg.train.log_every,
                          progress=cfg.run.progress, total_steps=self.total_steps,
                          term_names=self.term_names)

    # -- the loop -------------------------------------------------------------------------------
    def fit(self, resume: bool = False) -> dict:
        if resume:
            self.resume()
        self.install_signal_handlers()
        spe = self.pool.steps_per_epoch
        start, t_epoch = self.step, None
        while self.step < self.total_steps:
            epoch, s = divmod(self.step, spe)
            if s == 0:
                t_epoch = time.perf_counter()
            elif self.step == start:  # resumed mid-epoch: no whole-epoch time to report
                t_epoch = None
            res = self.train_step(epoch, s)
            self.handle_nonfinite(res)
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
    def train_step(self, epoch: int, s: int):
        t0 = time.perf_counter()
        if self.step == self.cfg.train.fail_at_step and self.comm.rank == self.cfg.train.fail_rank:
            raise InjectedFailure(f"injected failure at step {self.step} on rank {self.comm.rank} "
                                  f"(train.fail_at_step)")
        # Adam/SGD -> L-BFGS at optim.switch_to_lbfgs_epoch (a function of the step: all ranks agree)
        self.optimizer = lbfgs.maybe_switch(self.optimizer, self.model.parameters(),
                                            self.cfg.optim, epoch)
        step = self.lbfgs_step if lbfgs.is_lbfgs(self.optimizer) else self.first_order_step
        # a loss with a schedule (e.g. an annealed smoothing) reads the progress: a function of
        # the step, so every rank and a resumed run see the same loss
        getattr(self.task, "set_progress", lambda f: None)(self.step / self.total_steps)
        res = step(self.pool.local_indices(epoch, s), t0)
        res.times["step"] = time.perf_counter() - t0
        return res

    def first_order_step(self, idx, t0: float):
        """Adam/SGD: one global loss-and-gradient, clip, step (skipped if not finite)."""
        x = self.inputs(idx)
        t1 = time.perf_counter()
        self.lr = lr_at(self.step, self.total_steps, self.cfg.optim) * self.lr_scale
        set_lr(self.optimizer, self.lr)
        res = self.loss_and_grad(x)
        t2 = time.perf_counter()
        if res.finite:
            self.gs.clip_(self.cfg.optim.grad_clip, res.grad_norm)
            self.optimizer.step()
        res.times.update(data=t1 - t0, optimizer=time.perf_counter() - t2)
        return res

    def lbfgs_step(self, idx, t0: float):
        """L-BFGS: the closure is the same global loss-and-gradient (line search included)."""
        mb = self.cfg.train.micro_batch
        # big local batch + micro-batching: inputs built per micro-batch, at each evaluation
        x = lbfgs.LazyBatch(self.inputs, idx, mb) if 0 < mb < len(idx) else self.inputs(idx)
        t1 = time.perf_counter()
        self.lr = lbfgs.LBFGS_LR * self.lr_scale
        set_lr(self.optimizer, self.lr)
        if self._lbfgs_stepper is None:
            self._lbfgs_stepper = lbfgs.LBFGSStepper(self.loss_and_grad)
        res = self._lbfgs_stepper(self.optimizer, x)
        busy = sum(res.times.get(k, 0.0) for k in ("forward", "backward", "allreduce"))
        res.times.update(data=t1 - t0, optimizer=max(0.0, time.perf_counter() - t1 - busy))
        return res

    def handle_nonfinite(self, res):
        """All ranks see the same reduced loss and gradient, so all take this branch together."""
        if res.finite:
            return
        what = ", ".join(res.nonfinite_terms) if res.nonfinite_terms else "the gradient (grad_norm)"
        where = f"non-finite loss at step {self.step + 1}: term(s) {what}"
        if self.cfg.train.on_nonfinite == "rollback":
            path = ckpt.latest_checkpoint(self.run_dir)
            if path is not None and self.lr_scale > 1e-6:
                failed_at = self.step + 1
                self.restore(path)
                self.lr_scale *= self.cfg.train.rollback_lr_factor
                self.log.truncate_after(self.step)  # metrics.jsonl keeps one trajectory
                self.log.record({"kind": "rollback", "step": self.step, "failed_at": failed_at,
                                 "lr_scale": self.lr_scale})
                self.log.warn(f"{where}; rolled back to {os.path.basename(path)} with the "
                              f"learning rate scaled by {self.lr_scale:g}")
                return
        raise NonFiniteLoss(f"{where}. Lower optim.lr, set optim.grad_clip, or set "
                            f"train.on_nonfinite = \"rollback\" to restart from the last checkpoint.")

    def log_step(self, epoch: int, res):
        self.step += 1
        t = res.times
        bs = self.cfg.data.global_batch
        self.log.step({"kind": "step", "step": self.step, "epoch": epoch, "loss": res.loss,
                       **res.terms, "terms": res.terms, "grad_norm": res.grad_norm, "lr": self.lr,
                       **{f"time_{k}": v for k, v in t.items()},
                       "samples_per_s": bs / t["step"] if t["step"] > 0 else 0.0,
                       **lbfgs.step_metrics(res)})  # L-BFGS: optimizer, func_evals, lbfgs_iters

    def log_epoch(self, epoch: int, t_epoch):
        if t_epoch is None:  # resumed mid-epoch: no whole-epoch time to report
            return
        dt = time.perf_counter() - t_epoch
        n = self.pool.steps_per_epoch * self.cfg.data.global_batch
        self.log.record({"kind": "epoch", "epoch": epoch, "step": self.step, "time_epoch": dt,
                         "samples_per_s": n / dt})

    def maybe_evaluate(self, epoch: int):
        """Held-out error every ``train.eval_every_epochs`` epochs (a metrics record), so users
        see how the error falls with training time. Collective: every rank calls it."""
        every, n = self.cfg.train.eval_every_epochs, self.cfg.data.eval_samples
        if every <= 0 or n <= 0 or (epoch + 1) % every or self.step >= self.total_steps:
            return
        from .evaluate import evaluate

        s = evaluate(self.model, self.task, self.comm, n=n, seed=self.cfg.data.eval_seed,
                     dtype=self.dtype, channels_last=self.cfg.model.channels_last)
        if s is not None:
            self.log.record({"kind": "eval", "epoch": epoch, "step": self.step,
                             **{k: s[k] for k in ("rel_l2_mean", "rel_l2_median", "rel_l2_max")}})
            self.log.info(f"eval at epoch {epoch + 1}: held-out rel L2 mean {s['rel_l2_mean']:.4f} "
                          f"median {s['rel_l2_median']:.4f} worst {s['rel_l2_max']:.4f}")

    def check_in_sync(self):
        every = self.cfg.train.checksum_every
        if every <= 0 or self.step % every:
            return
        hi, lo = parameter_checksum(self.model, self.comm)
        if hi != lo:
            raise ParametersDiverged(f"parameters differ across ranks at step {self.step} "
                                     f"(checksums {lo!r} .. {hi!r}); this is a bug, please report it")

    # -- checkpoints ----------------------------------------------------------------------------
    def maybe_checkpoint(self, res):
        every = self.cfg.train.checkpoint_every
        if res.flags["stop"] > 0:
            self.save_checkpoint()
            raise Preempted(f"stop signal received: checkpoint written at step {self.step}; "
                            f"resume with --resume {self.run_dir}")
        if every > 0 and self.step % every == 0 and self.step < self.total_steps:
            self.save_checkpoint()

    def save_checkpoint(self):
        if self.comm.rank == 0:
            path = ckpt.checkpoint_path(self.run_dir, self.step)
            ckpt.save_checkpoint(path, model_state=self.model.state_dict(),
                                 optim_state=self.optimizer.state_dict(), rng_state=ckpt.capture_rng_state(),
                                 meta=self.meta())
            ckpt.prune_checkpoints(self.run_dir, self.cfg.train.keep_checkpoints)
        self.comm.barrier()  # nobody runs ahead of a checkpoint that may be needed for rollback

    def meta(self) -> dict:
        from .config import config_to_dict

        return {"step": self.step, "lr_scale": self.lr_scale, "world_size": self.comm.size,
                "config": config_to_dict(self.cfg), **self.specs,
                "optimizer": lbfgs.optimizer_name(self.optimizer, self.cfg.optim)}  # L-BFGS

    def restore(self, path: str):
        state = ckpt.load_checkpoint(path)
        self.model.load_state_dict(state["model_state"])
        # L-BFGS: rebuild the optimiser kind that wrote the checkpoint (adam before the switch)
        self.optimizer = lbfgs.optimizer_for_state(self.optimizer, self.model.parameters(),
                                                   self.cfg.optim, state["optim_state"],
                                                   state["meta"])
        self.optimizer.load_state_dict(state["optim_state"])
        self.gs.check_views()
        ckpt.restore_rng_state(state["rng_state"])
        self.step = int(state["meta"]["step"])
        self.lr_scale = float(state["meta"].get("lr_scale", 1.0))

    def resume(self):
        path = ckpt.latest_checkpoint(self.run_dir)
        if path is None:
            raise FileNotFoundError(f"--resume {self.run_dir}: no complete checkpoint in "
                                    f"{os.path.join(self.run_dir, 'checkpoints')}; start without --resume")
        self.restore(path)
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


def compiled(model, cfg):
    """torch.compile'd ``model`` (shares its parameters; the eager model stays the one saved)."""
    return torch.compile(model, dynamic=False)
