"""``deepfusion solve``: the classical reference solver on the inputs ``infer`` takes, on any
number of ranks, written to a fields file ``deepfusion compare`` reads beside a prediction.

The samples are shared over the ranks and written as ``infer`` shares and writes them
(:func:`deepfusion.app.fields_run.execute`); each batch's compute is the problem's reference
solver (:func:`solver_compute`), timed per call.

Kept light on imports: torch is imported only after the thread layout is set (engine.layout).
"""
from __future__ import annotations

import time

from deepfusion.app.fields_run import (check_batch, check_out, execute, input_args, resolve,
                                       set_threads)
from deepfusion.app.options import SOLVE_SET_HELP, add_set, problem_options
from deepfusion.app.policy import collective_check, run_distributed


def register(sub) -> None:
    """Add the solve subcommand to the ``deepfusion`` parser."""
    s = sub.add_parser("solve", help="the classical reference solver on the same inputs")
    s.add_argument("--problem", required=True,
                   help="a registered problem ('deepfusion problems' lists them), "
                        "'package.module:ClassName' importable from PYTHONPATH, or a "
                        "plugin's entry-point name")
    add_set(s, SOLVE_SET_HELP)
    s.add_argument("--method", default="auto",
                   help="reference solver method, one of the problem's reference_methods "
                        "(default auto; e.g. the linear solver where the problem has a choice)")
    input_args(s, "reference")
    s.set_defaults(run=run_solve)


def run_solve(args) -> int:
    return run_distributed(_solve, args)


def _build(args):
    from deepfusion.engine.predict.loader import problem_from_spec, parse_grid

    check_batch(args)
    opts = problem_options(args, "solve")
    if "grid" in opts:
        raise ValueError("problem.options.grid: give the grid with --grid HxW (DxHxW)")
    problem = problem_from_spec(args.problem, opts, parse_grid(args.grid))
    if args.inputs is not None:   # a problem that cannot solve given fields: said before reading them
        from diffnet.problems import check_reference

        check_reference(problem, "'deepfusion solve' has no solver to run")
        problem.check_method(args.method, from_inputs=True)
    return problem


def _solve(args, comm) -> int:
    check_out(comm, args)  # before the problem is built
    set_threads(comm, args.threads)
    problem = collective_check(comm, _build, args)
    problem, samples = resolve(comm, args, problem)
    solve = collective_check(comm, make_solver, problem, samples, args.method)
    compute = solver_compute(problem, samples, solve)
    attrs = {"source": f"reference:{args.method}", "kind": "reference"}
    return execute(comm, args, problem, samples, compute, attrs)


def make_solver(problem, samples, method: str = "auto"):
    """solve(j) -> (*grid) reference solution of sample j, from its fields or its parameters.

    The method, and whether the problem solves from given fields at all, are checked here,
    before any solve (``Problem.check_method``), so a bad choice fails up front on every rank.
    """
    from diffnet.problems import check_reference

    check_reference(problem, "'deepfusion solve' has no solver to run")
    from_fields = samples.fields is not None
    problem.check_method(method, from_inputs=from_fields)
    if from_fields:
        return lambda j: problem.solve_from_inputs(samples.fields[j], method)
    return lambda j: problem.reference_solution(samples.params[j], method)


def solver_compute(problem, samples, solve):
    """compute(lo, hi) -> Batch of the service's loop: the reference solutions of samples
    [lo, hi) and their inputs, float32 (solver calls timed)."""
    import numpy as np
    import torch

    from deepfusion.engine.predict.pipeline import Batch

    def compute(lo, hi):
        x = samples.inputs(problem, lo, hi, torch.float64)
        t0 = time.perf_counter()
        u = np.stack([solve(j) for j in range(lo, hi)])
        sec = time.perf_counter() - t0
        return Batch(u.astype(np.float32), x.numpy().astype(np.float32), lo=lo, hi=hi,
                     seconds=sec)
    return compute
