"""``deepfusion check-problem SPEC``: check a problem against the contract, one line per check.

SPEC is what ``problem.name`` takes: a registered problem name, ``package.module:ClassName``
importable from the PYTHONPATH, or a plugin's entry point. ``--grid`` and the problem options
(``--options`` as a TOML table, ``--set problem.options.KEY=VALUE``) are those the problem is
built with. The checks themselves are ``diffnet.problems.check.problem.check_problem`` (the same
function a user's own tests call); this module only reads the command line and prints. Exit
codes: 0 every check passed (or was skipped), 1 some check failed, 2 bad input (a spec that
does not import, options the problem refuses, a malformed flag), as every local command
(:mod:`.policy`). One process, no MPI.
"""
from __future__ import annotations

from deepfusion.app.options import set_options
from deepfusion.config.files import PROBLEM_OPTIONS
from deepfusion.app.policy import run_local

# As a test runner: 1 when some check failed (2, bad input, comes from the policy).
FAILED = 1

SPEC_HELP = ("a registered problem name ('deepfusion problems' lists them), "
             "package.module:ClassName (a Problem subclass importable from the PYTHONPATH), or "
             "an installed plugin's entry point name")
OPTIONS_HELP = ("the problem's options as a TOML table, e.g. '{n_terms = 6, omega_range = "
                "[-2, 2]}' (the [problem.options] table of a config; --set wins over it)")
SET_HELP = ("one problem option, problem.options.KEY=VALUE (or KEY=VALUE), VALUE in TOML as in "
            "'deepfusion train --set' (repeatable)")


def register(sub) -> None:
    p = sub.add_parser(
        "check-problem", help="check a problem (yours: package.module:ClassName) against the "
                              "contract: shapes, per-sample terms, draws, gradient, split, "
                              "checkpoint round trip")
    p.add_argument("spec", metavar="SPEC", help=SPEC_HELP)
    p.add_argument("--grid", metavar="HxW|DxHxW",
                   help="the grid to check on (default 16x16; 8x8x8 for a 3-D problem)")
    p.add_argument("--options", metavar="TOML", help=OPTIONS_HELP)
    p.add_argument("--set", action="append", metavar="problem.options.KEY=VALUE", help=SET_HELP)
    p.set_defaults(run=lambda args: run_local(cmd_check_problem, args))


def parse_table(text) -> dict:
    """``--options``: a TOML inline table ``{a = 1, b = "x"}`` or TOML lines ``a = 1``."""
    if text is None:
        return {}
    from deepfusion.config.files import import_toml

    toml = import_toml()
    body = str(text).strip()
    try:
        return dict(toml.loads(f"options = {body}")["options"] if body.startswith("{")
                    else toml.loads(body))
    except toml.TOMLDecodeError as e:
        raise ValueError(f"--options must be a TOML table, e.g. '{{n_terms = 6, omega_range = "
                         f"[-2, 2]}}', got {text!r} ({e})") from None


def given_options(args) -> dict:
    """``--options`` then ``--set`` (the later wins); a bare KEY=VALUE is a problem option."""
    items = [s if str(s).startswith(PROBLEM_OPTIONS) else PROBLEM_OPTIONS + str(s)
             for s in args.set or []]
    options = {**parse_table(args.options), **set_options(items, "check-problem")}
    if "grid" in options:
        raise ValueError("the grid is not a problem option here: give --grid HxW (DxHxW)")
    return options


def cmd_check_problem(args) -> int:
    from diffnet.problems.check.problem import check_problem

    from deepfusion.engine.predict.loader import parse_grid

    grid, options = parse_grid(args.grid), given_options(args)
    heading = [f"checking problem {args.spec}" + (f" with options {options}" if options else "")]

    def show(result) -> None:    # the heading once the problem is built (bad input: no lines)
        while heading:
            print(heading.pop(), flush=True)
        print(result.line(), flush=True)

    report = check_problem(args.spec, grid=grid, options=options, on_result=show)
    print(report.summary())
    return 0 if report.ok else FAILED
