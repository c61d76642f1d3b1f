"""L-BFGS for data-parallel DiffNet training, and the Adam-then-L-BFGS schedule.

The optimiser is ``torch.optim.LBFGS`` (lr = 1, strong-Wolfe line search by default) driven by a
closure that calls :class:`deepfusion.step.LossAndGrad`: every loss and gradient the optimiser
sees -- the first one of a step and every line-search evaluation -- is the *global* one over the
global batch (micro-batched backward, SUM-allreduced gradient buckets, loss terms and flags in
one fused allreduce). Parameters' ``.grad`` are views into the reduced buckets, so LBFGS reads
the global gradient directly. Loss and gradient are bit-identical on every rank, hence so are
all of LBFGS's decisions (line-search branches, tolerances, history updates) and its steps:
parameters stay equal on all ranks (the trainer's all-reduced checksum checks it).

Config (``[optim]``): ``name = "lbfgs"`` or ``switch_to_lbfgs_epoch = E`` (Adam/SGD for epochs
< E, L-BFGS from the first step of epoch E; the switch depends only on the step counter, so all
ranks switch at the same step), ``lbfgs_history``, ``lbfgs_max_iter`` (iterations per optimiser
step; max evaluations = 5/4 of it, torch's default), ``lbfgs_tolerance_grad``,
``lbfgs_tolerance_change``, ``lbfgs_line_search`` ("strong_wolfe" | "none"). L-BFGS ignores
``optim.lr`` and its schedule: its step length is 1 (times the rollback factor after a
``train.on_nonfinite = "rollback"``), scaled by the line search. Gradient clipping is not applied.

Memory: each evaluation runs over micro-batches of ``train.micro_batch`` samples, so activations
are bounded by the micro-batch. With :class:`LazyBatch` the *inputs* are also built per
micro-batch (``InputCache`` keeps them while they fit its cap, and rebuilds the rest at every
evaluation), so a rank never holds its whole local batch of inputs at once. On top of the
model, L-BFGS keeps 2 x ``lbfgs_history`` + ~4 flat vectors of the parameter count.

Metrics: :meth:`LBFGSStepper.__call__` returns the StepResult of the *first* evaluation of the
step (the loss at the parameters before the step, as for Adam) with ``times`` summed over all
evaluations, ``flags`` OR-ed over them, and ``metrics = {"optimizer": "lbfgs", "func_evals": n,
"lbfgs_iters": k, "samples_evaluated": n x global_batch, "loss_after": f}`` (``loss_after`` = the
lowest finite loss evaluated in the step, the accepted iterate's loss under the strong-Wolfe
line search). The trainer adds these to each step record of metrics.jsonl.

Non-finite values: if any evaluation (line search included) is non-finite -- decided on
all-reduced values, so on every rank alike -- the step is abandoned on every rank: parameters
return to their values at the start of the step, the L-BFGS history is cleared, and the
non-finite StepResult is returned, so the trainer's ``handle_nonfinite`` stops or rolls back
exactly as for Adam. Nobody hangs in a collective.

Checkpoints: the LBFGS state_dict (history lists of tensors, scalars, ``None`` entries) is saved
by ``deepfusion.checkpoint`` (HDF5, no pickle); ``meta["optimizer"]`` names the active optimiser
and :func:`optimizer_for_state` rebuilds the matching one before ``load_state_dict``, so a
resumed run continues the same iterates.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .step import LossAndGrad, StepResult

LBFGS_LR = 1.0


# ---------------------------------------------------------------------------------------------
# the optimiser
# ---------------------------------------------------------------------------------------------

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


def build_lbfgs(params, cfg, lr: float = LBFGS_LR) -> DistLBFGS:
    """L-BFGS from an ``optim`` config section."""
    return DistLBFGS(list(params), lr=lr, history_size=cfg.lbfgs_history,
                     max_iter=cfg.lbfgs_max_iter, tolerance_grad=cfg.lbfgs_tolerance_grad,
                     tolerance_change=cfg.lbfgs_tolerance_change,
                     line_search_fn=None if cfg.lbfgs_line_search == "none" else "strong_wolfe")


def is_lbfgs(optimizer) -> bool:
    return isinstance(optimizer, torch.optim.LBFGS)


def optimizer_name(optimizer, cfg) -> str:
    """The name recorded in checkpoint meta: "lbfgs" or the configured first-order one."""
    return "lbfgs" if is_lbfgs(optimizer) else ("adam" if cfg.name == "lbfgs" else cfg.name)


def lbfgs_active(cfg, epoch: int) -> bool:
    """Whether L-BFGS is the optimiser at ``epoch`` (a pure function of the step counter)."""
    return cfg.name == "lbfgs" or (cfg.switch_to_lbfgs_epoch >= 0
                                   and epoch >= cfg.switch_to_lbfgs_epoch)


def build(params, cfg, *, epoch: int = 0):
    """The optimiser active at ``epoch``: L-BFGS or ``optim.build_optimizer``'s Adam/SGD."""
    if lbfgs_active(cfg, epoch):
        return build_lbfgs(params, cfg)
    from .optim import build_optimizer

    return build_optimizer(params, cfg)


def maybe_switch(optimizer, params, cfg, epoch: int):
    """The optimiser to use at ``epoch``: ``optimizer`` itself, or a fresh L-BFGS from the first
    step of epoch ``optim.switch_to_lbfgs_epoch`` on (same step on every rank)."""
    if lbfgs_active(cfg, epoch) and not is_lbfgs(optimizer):
        return build_lbfgs(params, cfg)
    return optimizer


def _state_is_lbfgs(optim_state: dict) -> bool:
    groups = optim_state.get("param_groups") or [{}]
    return "history_size" in groups[0]


def optimizer_for_state(optimizer, params, cfg, optim_state: dict, meta: dict | None = None):
    """An optimiser of the kind that wrote ``optim_state`` (``meta["optimizer"]`` if recorded,
    else recognised from the state itself), reusing ``optimizer`` when it already matches.
    Call before ``load_state_dict`` on resume and rollback."""
    name = (meta or {}).get("optimizer")
    want_lbfgs = name == "lbfgs" if name is not None else _state_is_lbfgs(optim_state)
    if want_lbfgs == is_lbfgs(optimizer):
        return optimizer
    if want_lbfgs:
        return build_lbfgs(params, cfg)
    from .optim import build_optimizer

    first_order = cfg if cfg.name != "lbfgs" else _with_name(cfg, name or "adam")
    return build_optimizer(params, first_order)


def _with_name(cfg, name):
    import copy

    c = copy.copy(cfg)
    c.name = name
    return c


# ---------------------------------------------------------------------------------------------
# lazily built inputs
# ---------------------------------------------------------------------------------------------

class LazyBatch:
    """A local batch whose inputs are built per micro-batch, on demand, by ``build(indices)``
    (the trainer's ``InputCache``). ``len(batch)`` samples, ``micro_batch`` per chunk."""

    def __init__(self, build, indices, micro_batch: int):
        self.build, self.indices = build, list(indices)
        self.micro_batch = max(1, int(micro_batch)) if micro_batch > 0 else len(self.indices)

    def __len__(self):
        return len(self.indices)

    @property
    def shape(self):
        return (len(self.indices),)

    def chunks(self) -> "_LazyChunks":
        return _LazyChunks(self)


class _LazyChunks(Sequence):
    def __init__(self, batch: LazyBatch):
        self.b = batch

    def __len__(self):
        n, m = len(self.b.indices), self.b.micro_batch
        return (n + m - 1) // m

    def __getitem__(self, k):
        if not 0 <= k < len(self):
            raise IndexError(k)
        m = self.b.micro_batch
        return self.b.build(self.b.indices[k * m:(k + 1) * m])


class StreamingLossAndGrad(LossAndGrad):
    """:class:`LossAndGrad` that also accepts a :class:`LazyBatch`. Built from an existing one
    with :meth:`sharing`: same model, buckets, buffers and flags dict (the signal handler's
    stop request is seen by both)."""

    @classmethod
    def sharing(cls, lg: LossAndGrad) -> "StreamingLossAndGrad":
        obj = cls.__new__(cls)
        obj.__dict__ = lg.__dict__  # shared, not copied
        return obj

    def _chunks(self, x):
        if isinstance(x, LazyBatch):
            return x.chunks()
        return super()._chunks(x)


# ---------------------------------------------------------------------------------------------
# one optimiser step
# ---------------------------------------------------------------------------------------------

class _NonFinite(Exception):
    def __init__(self, result: StepResult):
        super().__init__("non-finite global loss or gradient")
        self.result = result


class LBFGSStepper:
    """Runs one ``optimizer.step(closure)`` on a fixed (global) batch; see the module doc."""

    def __init__(self, loss_and_grad: LossAndGrad):
        self.lg = loss_and_grad
        self.streaming = StreamingLossAndGrad.sharing(loss_and_grad)

    def __call__(self, optimizer: torch.optim.LBFGS, x) -> StepResult:
        evals: list[StepResult] = []
        evaluate = self.streaming if isinstance(x, LazyBatch) else self.lg

        def closure():
            res = evaluate(x)
            evals.append(res)
            if not res.finite:  # a global decision: every rank raises here together
                raise _NonFinite(res)
            return torch.tensor(res.loss, dtype=torch.float64)

        state = optimizer.state[optimizer._params[0]]
        iters0 = state.get("n_iter", 0)
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
        iters = (0 if failed is not None else optimizer.state[optimizer._params[0]].get("n_iter", 0)
                 - iters0)
        res = evals[0] if failed is None or failed is evals[0] else failed
        finite = [e.loss for e in evals if e.finite]
        res.times = {k: sum(e.times.get(k, 0.0) for e in evals) for k in evals[0].times}
        res.flags = {k: max(e.flags[k] for e in evals) for k in evals[0].flags}
        res.metrics = {"optimizer": "lbfgs", "func_evals": len(evals), "lbfgs_iters": iters,
                       "samples_evaluated": len(evals) * self.lg.global_batch,
                       "loss_after": min(finite) if finite else float("nan")}
        return res


def step_metrics(res) -> dict:
    """Extra per-step metrics carried by a StepResult (empty for first-order steps)."""
    return dict(getattr(res, "metrics", None) or {})


__all__ = ["DistLBFGS", "LBFGSStepper", "LazyBatch", "StreamingLossAndGrad", "build",
           "build_lbfgs", "is_lbfgs", "lbfgs_active", "maybe_switch", "optimizer_for_state",
           "optimizer_name", "step_metrics"]
