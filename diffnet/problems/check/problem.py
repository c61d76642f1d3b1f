"""The problem checker: does a PDE family keep the contract of :mod:`diffnet.problems.contract.base`
(its family, loss and answer head)?

``check_problem(spec, grid=..., options=...)`` builds the problem (a registered name, a
``"package.module:ClassName"`` string or a Problem subclass) on a small grid and runs, in one
process and in a few seconds:

* shapes and dtypes of every method's outputs, float32 and float64 (parameter draws,
  ``build_input``, ``impose``, ``answer``, ``loss_terms``, ``inputs_from_fields``, the
  reference solvers);
* per-sample terms: a sample's terms are the same in a batch of 3 and alone;
* deterministic draws: the same seed gives the same parameters and inputs, another seed others;
* a float64 gradient check of the loss w.r.t. the network output (directional differences);
* the answer head, if not ``Plain`` (:mod:`.check_head`): what it needs of the problem, and an
  answer at which the loss is stationary along each imposed field;
* split against undivided on blocks [1, 2] and [2, 2] (3-D: [1, 1, 2] and [2, 2, 2]) of the
  grid, emulated in threads (:mod:`diffnet.problems.check.split`): the blocks' answer is the
  undivided one and the sum over the blocks of each term equals the undivided term, value and
  gradient; a problem that refuses a split (``check_block``) has no domain parallelism there,
  which is reported, not failed;
* checkpoint round trip: ``config()`` survives JSON (what a checkpoint stores) and rebuilds a
  problem with the same options, draws and losses.

It returns a :class:`CheckReport` with one :class:`CheckResult` per check (OK, FAIL naming the
method at fault, what it returned against what was expected and where in the problem's source
the method is, :mod:`.source`, or SKIP saying why);
``report.assert_ok()`` raises for a user's own test. A spec that cannot be resolved or options
the problem refuses raise :class:`ProblemSpecError` (a ValueError) before any check runs.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

from diffnet.problems.contract.base import Problem
from diffnet.problems.check.head import check_head
from diffnet.problems.check.methods import (Fault, Skipped, Subject, check_attributes, check_draws,
                            check_fields, check_gradient, check_parameters, check_per_sample,
                            check_reference_solution, check_round_trip, check_solve_from_inputs,
                            shapes_check, split_check)
from diffnet.problems.check.source import locate
from diffnet.problems.contract.registry import check_class, resolve

DEFAULT_GRIDS = {2: (16, 16), 3: (8, 8, 8)}
OK, FAIL, SKIP = "OK", "FAIL", "SKIP"


class ProblemSpecError(ValueError):
    """The spec does not name a problem, or the problem refuses the options or the grid."""


class ProblemCheckFailed(AssertionError):
    """Raised by :meth:`CheckReport.assert_ok`: the report's text, failures first."""


@dataclass(kw_only=True)
class CheckResult:
    """One check: its name, OK / FAIL / SKIP, the method at fault (FAIL) and what happened."""

    check: str
    status: str
    method: str = ""
    detail: str = ""
    source: str = ""

    def line(self) -> str:
        if self.status == FAIL:
            where = f" [{self.source}]" if self.source else ""
            return f"FAIL  {self.check}: {self.method} {self.detail}{where}"
        return f"{self.status:<5} {self.check}" + (f": {self.detail}" if self.detail else "")


@dataclass(kw_only=True)
class CheckReport:
    """Every check's result for one problem on one grid with one set of options."""

    spec: str
    grid: tuple
    options: dict
    results: list = field(default_factory=list)

    @property
    def failures(self) -> list:
        return [r for r in self.results if r.status == FAIL]

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        n = {s: sum(r.status == s for r in self.results) for s in (OK, FAIL, SKIP)}
        return (f"{self.spec} on {'x'.join(map(str, self.grid))}: {n[OK]} OK, {n[FAIL]} FAIL, "
                f"{n[SKIP]} SKIP")

    def text(self) -> str:
        return "\n".join([r.line() for r in self.results] + [self.summary()])

    def assert_ok(self) -> "CheckReport":
        if not self.ok:
            raise ProblemCheckFailed("\n".join([r.line() for r in self.failures]
                                               + [self.summary()]))
        return self


# -- the spec ----------------------------------------------------------------------------------
def resolve_spec(spec) -> type[Problem]:
    """The Problem class of a registered name, "package.module:ClassName", a plugin's entry
    point (the registry's ways, :func:`diffnet.problems.contract.registry.resolve`) or a class."""
    try:
        if inspect.isclass(spec):
            return check_class(spec, getattr(spec, "__qualname__", str(spec)))
        return resolve(spec)
    except ValueError as e:
        raise ProblemSpecError(str(e)) from None


def subject(spec, grid=None, options=None) -> Subject:
    """The problem under check; ProblemSpecError if it cannot be built as asked."""
    cls = resolve_spec(spec)
    label = spec if isinstance(spec, str) else f"{cls.__module__}:{cls.__qualname__}"
    options = dict(options or {})
    dims = int(getattr(cls, "dims", 2))
    grid = tuple(int(g) for g in (grid or DEFAULT_GRIDS.get(dims, (16,) * dims)))
    if len(grid) != dims:
        raise ProblemSpecError(f"grid {'x'.join(map(str, grid))} has {len(grid)} axes, but "
                               f"problem {label!r} is {dims}-D")
    from diffnet.problems import option_names

    valid = option_names(cls)
    bad = sorted(k for k in options if k not in valid or k == "grid")
    if bad:
        raise ProblemSpecError(f"unknown option(s) {bad} for problem {label!r} (the grid is "
                               f"given apart); valid options: {[k for k in valid if k != 'grid']}")
    s = Subject(cls=cls, label=label, grid=grid, options=options)
    try:
        s.make()
    except Exception as e:  # noqa: BLE001 -- the user's constructor may fail in any way
        where = locate(cls, "__init__", e)
        raise ProblemSpecError(f"problem {label!r} cannot be built on grid {list(grid)} with "
                               f"options {options}: {type(e).__name__}: {e}"
                               + (f" [{where}]" if where else "")) from None
    return s


def check_problem(spec, *, grid=None, options=None,
                  on_result: Callable[[CheckResult], None] | None = None) -> CheckReport:
    """Check problem ``spec`` on ``grid`` (default 16x16, 3-D 8x8x8) with ``options`` (the
    constructor's keyword options, as ``problem.options`` of a config); see the module
    docstring. ``on_result`` is called with each result as soon as it is known."""
    s = subject(spec, grid, options)
    report = CheckReport(spec=s.label, grid=s.grid, options=s.options)
    for name, check in checks(s):
        try:
            detail = check(s) or ""
            result = CheckResult(check=name, status=OK, detail=detail)
        except Fault as f:
            result = CheckResult(check=name, status=FAIL, method=f.method, detail=f.detail,
                                 source=locate(s.cls, f.method, f.raised))
        except Skipped as e:
            result = CheckResult(check=name, status=SKIP, detail=str(e))
        except Exception as e:  # noqa: BLE001 -- outside the methods' calls: an attribute
            result = CheckResult(check=name, status=FAIL, method="the problem",
                                 detail=f"raised {type(e).__name__}: {e}",
                                 source=locate(s.cls, "", e))
        report.results.append(result)
        if on_result is not None:
            on_result(result)
    return report


def checks(s: Subject) -> list:
    splits = [[1] * (len(s.grid) - 1) + [2], [2] * len(s.grid)]
    return ([("class attributes", check_attributes), ("parameters", check_parameters),
             ("deterministic draws", check_draws)]
            + [(f"shapes and dtypes, {d}", shapes_check(d)) for d in ("float32", "float64")]
            + [("inputs_from_fields", check_fields), ("per-sample terms", check_per_sample),
               ("float64 gradient", check_gradient), ("answer head", check_head),
               ("reference_solution", check_reference_solution),
               ("solve_from_inputs", check_solve_from_inputs)]
            + [(f"split {sp} against undivided", split_check(sp)) for sp in splits]
            + [("checkpoint round trip", check_round_trip)])


__all__ = ["check_problem", "CheckReport", "CheckResult", "ProblemSpecError",
           "ProblemCheckFailed", "DEFAULT_GRIDS"]
