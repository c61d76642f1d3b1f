"""``deepfusion``: train, demo, evaluate, infer, solve, compare, export, config, problems,
check-problem, check, status, plot, jobs.

The top of the package: the parser is built here from every subcommand's own ``register``, the
application's (:mod:`deepfusion.app`) and the job tools' (:mod:`deepfusion.jobs.cli`); no module
of the package imports this one (``deepfusion/__main__.py`` and the console script run it).
Each command module is imported when its command runs, because torch must be imported only
after the thread layout is set (OpenMP reads OMP_NUM_THREADS once). Exit codes and the error
policy: :mod:`deepfusion.app.policy`.
"""
from __future__ import annotations

import argparse
import sys

from deepfusion.app import compare, evaluate, export, infer, solve
from deepfusion.app import check as check_cli
from deepfusion.app import check_problem as check_problem_cli
from deepfusion.app import problems as problems_cli
from deepfusion.app import status as status_cli
from deepfusion.app.policy import ExitCode, run_distributed, run_local
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
    t = sub.add_parser("train", help="train a DiffNet generator (any number of MPI ranks)")
    t.add_argument("config", nargs="?", default=None,
                   help="TOML config (keys not in it take their defaults; problem.name has none; "
                        "with --resume, RUN_DIR/config.toml is read if no config is given)")
    t.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config key, VALUE in TOML, e.g. train.max_steps=100 or "
                        "problem.options.c_range=[3, 6] (repeatable; 'deepfusion config' lists "
                        "the keys)")
    t.add_argument("--resume", metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its newest complete checkpoint (on any "
                        "number of ranks that divides data.global_batch)")
    t.add_argument("--overwrite", action="store_true", help="replace an existing run in run.dir")
    t.set_defaults(run=_distributed("cmd_train"))
    d = sub.add_parser("demo", help="train configs/demo.toml on mpiexec -n NP, one thread per "
                                    "rank, and print its validation error")
    d.add_argument("--np", type=int, default=2, metavar="NP",
                   help="number of MPI ranks to launch (default 2)")
    d.add_argument("--run-dir", default="runs/demo",
                   help="run directory, replaced if it exists (default runs/demo)")
    d.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a key of the demo config, as 'deepfusion train --set' "
                        "(repeatable)")
    d.set_defaults(run=_local("cmd_demo"))
    evaluate.register(sub)
    c = sub.add_parser("config", help="list every config key, or print a resolved config")
    c.add_argument("config", nargs="?", metavar="FILE",
                   help="a TOML config: print it resolved (every key, defaults filled in) after "
                        "checking it, problem and model options included; without FILE or --set: "
                        "list every key with its type, default and help")
    c.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config key before printing, as 'deepfusion train --set' "
                        "(repeatable)")
    c.add_argument("--markdown", action="store_true",
                   help="print the reference of every key as Markdown (the reference of "
                        "docs/configuration.md)")
    c.set_defaults(run=_local("cmd_config"))
    infer.register(sub)
    solve.register(sub)
    compare.register(sub)
    export.register(sub)
    problems_cli.register(sub)
    check_problem_cli.register(sub)
    check_cli.register(sub)
    status_cli.register(sub)
    register_jobs(sub)
    spelt_whole(p)
    return p


def spelt_whole(parser: argparse.ArgumentParser) -> None:
    """Every flag of ``parser`` and of its subcommands is taken only as spelt: argparse would
    otherwise read any unambiguous prefix (``--sample`` as ``--samples``), a second name for it."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                spelt_whole(sub)


def _local(name: str):
    def run(args) -> int:
        from deepfusion.app import train

        return run_local(getattr(train, name), args)
    return run


def _distributed(name: str):
    def run(args) -> int:
        if name == "cmd_train":  # a stop signal during start-up is kept for the first step
            from deepfusion.engine.run import stop
            try:
                stop.install()
            except ValueError as e:  # a malformed DEEPFUSION_STOP_DEADLINE / _START_TIMEOUT
                print(f"deepfusion: error: {e}", file=sys.stderr, flush=True)
                return ExitCode.INPUT
        from deepfusion.app import train

        return run_distributed(getattr(train, name), args)
    return run


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
