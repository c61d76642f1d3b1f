"""Faults in the training loop, injected through the product's one test hook
(:mod:`deepfusion.engine.run.hook`: ``DEEPFUSION_TEST_HOOK`` names this module).

``DEEPFUSION_FAULT`` holds comma-separated faults ``KIND@STEP[:RANK]`` (RANK defaults to 0),
each fired at most once per process as global step STEP starts, numbered as the log and
``metrics.jsonl`` number the steps (from 1):

* ``raise@13:1``  rank 1 raises :class:`InjectedFailure` during step 13 (an exception on one
  rank only; steps 1 to 12 are logged);
* ``nan@5``       rank 0's loss of step 5 is made non-finite (a transient NaN; its gradient
  stays finite);
* ``hang@7:1``    rank 1 blocks for good during step 7 in a C call that holds the GIL (as
  MPI_Init waiting for peers, or a parser looping on a damaged file): no Python code of that
  process runs again, so only the stop watchdog (``deepfusion.engine.run.stop``) or SIGKILL
  ends it;
* ``slow@3:1``    rank 1 sleeps :data:`SLOW_S` seconds during step 3 after its backward pass,
  before its gradient all-reduce (a rank late to the all-reduce: the others wait for it there).

A launch gets both variables from :func:`fault_env`. A malformed value is refused as bad input
by ``deepfusion train`` on every rank before anything is built (the hook is loaded there).
"""
from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass, field

from deepfusion.engine.run.hook import ENV as HOOK

ENV = "DEEPFUSION_FAULT"
KINDS = ("raise", "nan", "hang", "slow")
SLOW_S = 0.5  # seconds a ``slow`` fault delays its rank's gradient all-reduce


class InjectedFailure(RuntimeError):
    """A failure on one rank only (the other ranks wait for it in a collective)."""


def fault_env(faults: str) -> dict:
    """The environment of a launch with ``faults`` (``KIND@STEP[:RANK],...``) injected."""
    return {HOOK: __name__, ENV: faults}


def parse(text: str) -> list[tuple[str, int, int]]:
    """(kind, step, rank) of every fault in ``text``; ValueError naming a malformed item."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        kind, _, where = item.partition("@")
        step, _, on = where.partition(":")
        if kind not in KINDS or not step.isdigit() or int(step) < 1 or (on and not on.isdigit()):
            raise ValueError(f"{ENV}={text!r}: cannot read {item!r}; use KIND@STEP[:RANK] with "
                             f"KIND one of {', '.join(KINDS)}, STEP the step as the log numbers "
                             f"it (from 1) and RANK a rank (default 0), e.g. raise@13:1; or "
                             f"unset {ENV}")
        out.append((kind, int(step), int(on or 0)))
    return out


@dataclass
class Faults:
    """The faults of this process, parsed from ``DEEPFUSION_FAULT``."""

    rank: int
    planned: list[tuple[str, int, int]] = field(default_factory=list)
    slow: bool = False  # a ``slow`` fault is due in the step just started

    def fire(self, taken: int) -> bool:
        """Called as the loop starts a step, with ``taken`` the steps taken before it (so the
        step is logged as ``taken + 1``): raise a planned ``raise`` fault for that step on this
        rank; True if a ``nan`` fault is due (the caller poisons the loss). Each fault fires
        once. A ``slow`` fault due is left in :attr:`slow` for the caller."""
        step = taken + 1
        poison = False
        self.slow = False
        for fault in list(self.planned):
            kind, at, on = fault
            if at != step or on != self.rank:
                continue
            self.planned.remove(fault)
            if kind == "raise":
                raise InjectedFailure(f"injected failure at step {step} on rank {self.rank} "
                                      f"({ENV})")
            if kind == "hang":
                hang_in_native_code()
            if kind == "slow":
                self.slow = True
                continue
            poison = True
        return poison


def step_hook(rank: int):
    """The hook's entry (:func:`deepfusion.engine.run.hook.load`): the faults of ``rank`` fired
    as each step starts, or None when ``DEEPFUSION_FAULT`` plans none."""
    faults = Faults(rank, parse(os.environ.get(ENV, "")))
    if not faults.planned:
        return None

    def at_step(trainer) -> None:
        if faults.fire(trainer.step):
            poison_next_loss(trainer.loss_and_grad)
        if faults.slow:
            delay_next_reduce(trainer.loss_and_grad.gs, SLOW_S)
    return at_step


def delay_next_reduce(grads, seconds: float) -> None:
    """Sleep ``seconds`` before the next gradient reduction of ``grads`` (a GradSync) on this
    rank: after its backward pass has ended, so the delay is this rank's late arrival."""
    def once():
        del grads.reduce  # the class's own method again from the next call on
        time.sleep(seconds)
        grads.reduce()
    grads.reduce = once


def poison_next_loss(loss_and_grad) -> None:
    """Make the first loss term of the next evaluation non-finite on this rank, its value only:
    the NaN is added to the term, so the backward pass (the derivative of a sum) and the
    gradient stay as they were, and every rank sees the NaN in the step's reduced loss."""
    def once(x):
        del loss_and_grad.forward_terms  # the class's own method again from the next call on
        terms = type(loss_and_grad).forward_terms(loss_and_grad, x)
        first = loss_and_grad.term_names[0]
        terms[first] = terms[first] + float("nan")
        return terms
    loss_and_grad.forward_terms = once


def hang_in_native_code() -> None:
    """Lock a fresh mutex twice from C with the GIL held (ctypes.PyDLL keeps it): the second
    lock waits forever, and signals do not interrupt it (their C handlers run and return)."""
    libc = ctypes.PyDLL(None)
    mutex = ctypes.create_string_buffer(64)  # zeroed: PTHREAD_MUTEX_INITIALIZER (glibc, musl)
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)
