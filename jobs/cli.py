"""``deepfusion jobs render|sweep|model``: the job-script and scaling-study tools as subcommands."""
from __future__ import annotations


def register(sub):
    p = sub.add_parser("jobs", help="render cluster job scripts, run scaling sweeps, the scaling model")
    p.add_argument("tool", choices=("render", "sweep", "model"))
    p.add_argument("rest", nargs="...", help="the tool's own options (see --help of each)")
    p.set_defaults(run=_run)


def _run(args) -> int:
    import importlib

    mod = importlib.import_module(f"jobs.{args.tool}")
    return int(mod.main(args.rest) or 0)
