"""``deepfusion`` command line: train, demo, evaluate, config, infer, solve, compare, jobs.

The parser is built here from every subcommand's own ``register``; each command module is
imported when its command runs, because torch must be imported only after the thread layout is
set (OpenMP reads OMP_NUM_THREADS once). Exit codes and the error policy: :mod:`.policy`.
"""
from __future__ import annotations

import argparse
import sys

from jobs.cli import register as register_jobs

from . import inference_cli
from .policy import run_distributed, run_local


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepfusion", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a DiffNet generator (any number of MPI ranks)")
    t.add_argument("config", nargs="?", default=None,
                   help="TOML config (keys not in it take their defaults; problem.name has none; "
                        "with --resume, RUN_DIR/config.toml is read if no config is given)")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key")
    t.add_argument("--resume", metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its newest complete checkpoint (on any "
                        "number of ranks that divides data.global_batch)")
    t.add_argument("--overwrite", action="store_true", help="replace an existing run in run.dir")
    t.set_defaults(run=_distributed("cmd_train"))
    d = sub.add_parser("demo", help="the demo config on mpiexec -n 2")
    d.add_argument("--np", type=int, default=2)
    d.add_argument("--run-dir", default="runs/demo")
    d.add_argument("--set", action="append", metavar="KEY=VALUE")
    d.set_defaults(run=_local("cmd_demo"))
    e = sub.add_parser("evaluate", help="relative L2 of a checkpoint on a test draw never used "
                                        "for tuning (any number of ranks)")
    e.add_argument("checkpoint", help="a checkpoint file, or a run directory (its newest one)")
    e.add_argument("--seed", type=int, default=None,
                   help="seed of the draws (default: the run's data.test_seed)")
    e.add_argument("--samples", type=int, default=None,
                   help="number of draws (default: the run's data.test_samples)")
    e.add_argument("--out", metavar="FILE.json",
                   help="summary file (default RUN_DIR/eval_seed<SEED>.json)")
    e.add_argument("--threads", type=int, default=0, help="threads per rank (0 = auto)")
    e.add_argument("--option", action="append", metavar="KEY=VALUE", help=inference_cli.ANSWER_OPTION_HELP)
    e.set_defaults(run=_distributed("cmd_evaluate"))
    c = sub.add_parser("config", help="list config keys, or print a resolved config")
    c.add_argument("config", nargs="?")
    c.add_argument("--set", action="append", metavar="KEY=VALUE")
    c.set_defaults(run=_local("cmd_config"))
    inference_cli.register(sub)
    register_jobs(sub)
    return p


def _local(name: str):
    def run(args) -> int:
        from . import train

        return run_local(getattr(train, name), args)
    return run


def _distributed(name: str):
    def run(args) -> int:
        if name == "cmd_train":  # a stop signal during start-up is kept for the first step
            from ..engine import stop

            stop.install()
        from . import train

        return run_distributed(getattr(train, name), args)
    return run


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
