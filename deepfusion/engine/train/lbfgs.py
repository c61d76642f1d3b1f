"""L-BFGS for data-parallel DiffNet training, behind the stepper interface of :mod:`.optim`.

The optimiser is ``torch.optim.LBFGS`` (lr = 1, strong-Wolfe line search by default) driven by a
closure that calls :class:`deepfusion.engine.train.step.LossAndGrad`: every loss and gradient the optimiser
sees -- the first one of a step and every line-search evaluation -- is the *global* one over the
global batch (micro-batched backward, SUM-allreduced gradient buckets, loss terms and flags in
one fused allreduce). Parameters' ``.grad`` are views into the reduced buckets, so LBFGS reads
the global gradient directly. Loss and gradient are bit-identical on every rank, hence so are
all of LBFGS's decisions (line-search branches, tolerances, history updates) and its steps:
parameters stay equal on all ranks (the trainer's all-reduced checksum checks it).

Config (``[optim]``): ``name = "lbfgs"`` or ``switch_to_lbfgs_epoch = E`` (Adam/SGD for epochs
< E, L-BFGS from the first step of epoch E; decided in :mod:`.optimizers`), ``lbfgs_history``, ``lbfgs_max_iter`` (iterations per optimiser
step; max evaluations per step: :func:`max_evaluations`), ``lbfgs_tolerance_grad``,
``lbfgs_tolerance_change``, ``lbfgs_line_search`` ("strong_wolfe" | "none"). L-BFGS ignores
``optim.lr`` and its schedule: its step length is 1 (times the rollback factor after a
``train.on_nonfinite = "rollback"``), scaled by the line search. Gradient clipping is not applied.

Memory: each evaluation runs over micro-batches of ``train.micro_batch`` samples, so activations
are bounded by the micro-batch. With a :class:`~deepfusion.engine.parallel.data.LazyBatch` the *inputs* are also built per
micro-batch (the trainer's ``InputCache`` keeps them while they fit its cap, and rebuilds the rest at every
evaluation), so a rank never holds its whole local batch of inputs at once. On top of the
model, L-BFGS keeps 2 x ``lbfgs_history`` + ~4 flat vectors of the parameter count.

Metrics: :meth:`LBFGSStepper.step` returns the StepResult of the *first* evaluation of the
step (the loss at the parameters before the step, as for Adam) with ``times`` summed over all
evaluations, ``flags`` OR-ed over them, and ``metrics = {"optimizer": "lbfgs", "func_evals": n,
"lbfgs_iters": k, "samples_evaluated": n x global_batch, "loss_after": f}`` (``loss_after`` = the
lowest finite loss evaluated in the step, the accepted iterate's loss under the strong-Wolfe
line search). The trainer adds these to each step record of metrics.jsonl.

A rejected step: when the line search finds no point below the step's starting loss it
returns step length 0, the parameters do not move, and torch's LBFGS would build the next
step from the same history (no new curvature pair: its s is 0), on a new batch that the
same too-long direction overshoots again: a run that silently stops learning. Here a rejected step clears the history, so the next step starts
afresh from the scaled gradient, and its record says ``"lbfgs_restart": true``.

Non-finite values: if any evaluation (line search included) is non-finite -- decided on
all-reduced values, so on every rank alike -- the step is abandoned on every rank: parameters
return to their values at the start of the step, the L-BFGS history is cleared, and the
non-finite StepResult is returned, so the trainer stops or rolls back exactly as for Adam. Nobody hangs in a collective.

Checkpoints: the LBFGS state_dict (history lists of tensors, scalars, ``None`` entries) is saved
by the checkpoint module (HDF5, no pickle); ``meta["optimizer"]`` names the active stepper and
the trainer rebuilds the same one before ``load_state_dict``, so a resumed run continues the
same iterates.
"""
from __future__ import annotations

import time

import torch

from deepfusion.engine.parallel import commstats
from deepfusion.engine.parallel.data import LazyBatch
from deepfusion.engine.train.stepper import Stepper
from deepfusion.engine.train.step import LossAndGrad, StepResult

# L-BFGS's own step length; the line search scales it, a rollback multiplies it.
STEP_LENGTH = 1.0
# Loss evaluations a step's line search may always spend beyond its iterations.
LINE_SEARCH_EVALS = 4


def max_evaluations(max_iter: int, line_search: str) -> int:
    """Loss evaluations per optimiser step: torch's default 5/4 of the iterations, but at least
    ``LINE_SEARCH_EVALS`` more than them under a line search. torch charges the line search's
    evaluations to this budget, so with 5/4 alone a one-iteration step (5/4 of 1 is 1) has
    none left: it tries the full step once and, if that is not lower, does not move at all."""
    budget = max_iter * 5 // 4
    return budget if line_search == "none" else max(budget, max_iter + LINE_SEARCH_EVALS)


class DistLBFGS(torch.optim.LBFGS):
    """torch's LBFGS, tolerant of channels_last parameters/gradients (torch gathers the flat
    gradient with ``.view(-1)``, which fails on them; here it is gathered in logical order,
    the order in which ``_add_grad`` applies the update)."""

    def _gather_flat_grad(self):
        views = []
        for p in self._params:
            if p.grad is None:
                views.append(p.new_zeros(p.numel()))
            else:
                g = p.grad.to_dense() if p.grad.is_sparse else p.grad
                views.append(g.reshape(-1))
        return torch.cat(views, 0)


class _NonFinite(Exception):
    def __init__(self, result: StepResult):
        super().__init__("non-finite global loss or gradient")
        self.result = result


class LBFGSStepper(Stepper):
    """One ``optimizer.step(closure)`` per training step on a fixed (global) batch."""

    name = "lbfgs"

    def __init__(self, params, cfg, loss_and_grad: LossAndGrad):
        opt = DistLBFGS(list(params), lr=STEP_LENGTH, history_size=cfg.lbfgs_history,
                        max_iter=cfg.lbfgs_max_iter,
                        max_eval=max_evaluations(cfg.lbfgs_max_iter, cfg.lbfgs_line_search),
                        tolerance_grad=cfg.lbfgs_tolerance_grad,
                        tolerance_change=cfg.lbfgs_tolerance_change,
                        line_search_fn=None if cfg.lbfgs_line_search == "none" else "strong_wolfe")
        super().__init__(opt, cfg, loss_and_grad)

    def step(self, batch: LazyBatch, *, step, schedule_steps, lr_scale) -> StepResult:
        t0 = time.perf_counter()
        # a big local batch with micro-batching: inputs built per micro-batch, at each evaluation
        x = batch if 0 < batch.micro_batch < len(batch) else batch.materialize()
        t1 = time.perf_counter()
        lr = STEP_LENGTH * lr_scale
        self._set_lr(lr)
        res = self.run(x)
        busy = sum(res.times.get(k, 0.0) for k in ("forward", "backward", "allreduce"))
        res.times.update(data=t1 - t0, optimizer=max(0.0, time.perf_counter() - t1 - busy))
        res.lr = lr
        return res

    def run(self, x) -> StepResult:
        """``optimizer.step(closure)`` on inputs ``x``; see the module docstring."""
        optimizer, evals = self.optimizer, []

        def closure():
            res = self.lg(x)
            evals.append(res)
            if not res.finite:  # a global decision: every rank raises here together
                raise _NonFinite(res)
            return torch.tensor(res.loss, dtype=torch.float64)

        iters0 = optimizer.state[optimizer._params[0]].get("n_iter", 0)
        with torch.no_grad():
            start = [p.detach().clone() for p in optimizer._params]
        failed = None
        try:
            optimizer.step(closure)
        except _NonFinite as exc:
            failed = exc.result
            with torch.no_grad():
                for p, p0 in zip(optimizer._params, start):
                    p.copy_(p0)
            optimizer.state.clear()  # the history is half-updated: start it afresh
        del start
        state = optimizer.state.get(optimizer._params[0], {})
        iters = 0 if failed is not None else state.get("n_iter", 0) - iters0
        rejected = failed is None and bool(state.get("t", 1) == 0)
        if rejected:  # nothing moved: start the history afresh (module docstring)
            optimizer.state.clear()
        res = evals[0] if failed is None or failed is evals[0] else failed
        finite = [e.loss for e in evals if e.finite]
        res.times = {k: sum(e.times.get(k, 0.0) for e in evals) for k in evals[0].times}
        res.flags = {k: max(e.flags[k] for e in evals) for k in evals[0].flags}
        res.comm = commstats.combine([e.comm for e in evals])
        res.metrics = {"optimizer": "lbfgs", "func_evals": len(evals), "lbfgs_iters": iters,
                       "samples_evaluated": len(evals) * self.lg.global_batch,
                       "loss_after": min(finite) if finite else float("nan"),
                       "lbfgs_restart": rejected}
        return res
