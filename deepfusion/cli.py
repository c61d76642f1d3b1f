"""``deepfusion``: train, demo, evaluate, calibrate, infer, solve, compare, export, config,
problems, check-problem, check, status, plot, jobs, launch.

The top of the package: the parser is built here from every subcommand's own ``register``, the
application's (:mod:`deepfusion.app`) and the job tools' (:mod:`deepfusion.jobs.cli`); no module
of the package imports this one (``deepfusion/__main__.py`` and the console script run it).
The command modules keep torch out of their module level (each imports it when its command runs),
because torch must be imported only after the thread layout is set (OpenMP reads
OMP_NUM_THREADS once). Exit codes and the error
policy: :mod:`deepfusion.app.policy`.
"""
from __future__ import annotations

import argparse
import sys

from deepfusion.app import (calibrate, compare, config_command, demo, evaluate, export, infer,
                            launch, solve, train)
from deepfusion.app import check as check_cli
from deepfusion.app import check_problem as check_problem_cli
from deepfusion.app import problems as problems_cli
from deepfusion.app import status as status_cli
from deepfusion.jobs.cli import register as register_jobs
from deepfusion.version import __version__


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deepfusion", epilog="deepfusion COMMAND --help: the options of one command",
        description="Train DiffNet generators (data-free neural PDE solvers) on CPU clusters "
                    "with MPI ranks and threads, and evaluate, infer and solve with them.")
    p.add_argument("--version", action="version", version=f"deepfusion {__version__}",
                   help="print the version of deepfusion and exit")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    train.register(sub)
    demo.register(sub)
    evaluate.register(sub)
    calibrate.register(sub)
    config_command.register(sub)
    infer.register(sub)
    solve.register(sub)
    compare.register(sub)
    export.register(sub)
    problems_cli.register(sub)
    check_problem_cli.register(sub)
    check_cli.register(sub)
    status_cli.register(sub)
    register_jobs(sub)
    launch.register(sub, check=parse_command)
    spelt_whole(p)
    return p


def parse_command(argv: list[str]) -> None:
    """What ``deepfusion launch`` runs on every rank parses as a command of its own (argparse's
    message and exit 2 otherwise), before any rank starts."""
    build_parser().parse_args(argv)


def spelt_whole(parser: argparse.ArgumentParser) -> None:
    """Every flag of ``parser`` and of its subcommands is taken only as spelt: argparse would
    otherwise read any unambiguous prefix (``--sample`` as ``--samples``), a second name for it."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                spelt_whole(sub)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
