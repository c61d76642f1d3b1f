"""``deepfusion jobs render|sweep|model|project``: the job-script and scaling-study tools as subcommands."""
from __future__ import annotations

TOOLS = ("render", "sweep", "model", "project")


def register(sub):
    p = sub.add_parser("jobs", help="render cluster job scripts, run scaling sweeps, the scaling model")
    p.add_argument("tool", choices=TOOLS,
                   help="render: a cluster job script; sweep: a ranks x threads scaling study; "
                        "model: the scaling model; project: time to accuracy on a "
                        "cluster from a batch study")
    p.add_argument("rest", nargs="...", metavar="...",
                   help="the tool's own options (deepfusion jobs TOOL --help)")
    p.set_defaults(run=run)


def run(args) -> int:
    """Run one tool with its own arguments (each tool imports what it needs when it runs)."""
    if args.tool == "render":
        from deepfusion.jobs.render import main
    elif args.tool == "sweep":
        from deepfusion.jobs.sweep import main
    elif args.tool == "project":
        from deepfusion.jobs.project import main
    else:
        from deepfusion.jobs.model import main
    return int(main(args.rest) or 0)
