"""``deepfusion config [FILE] [--set ...] [--markdown]``: every config key, a config resolved
and checked, or the reference of every key as Markdown (docs/configuration.md)."""
from __future__ import annotations

import sys

from deepfusion.app.policy import run_local
from deepfusion.config import load_config


def register(sub) -> None:
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
    c.set_defaults(run=lambda args: run_local(cmd_config, args))


def cmd_config(args) -> int:
    """The resolved config of FILE (checked against the problem and model registries), the
    list of every key, or (``--markdown``) the reference of every key."""
    from deepfusion.config import describe, dump_toml

    if args.markdown:
        if args.config or args.set:
            raise ValueError("--markdown prints the reference of every key: give no FILE and "
                             "no --set with it")
        from deepfusion.config.reference import markdown_reference

        print(markdown_reference(), end="")
    elif args.config or args.set:
        from deepfusion.app.problems import check_registry_options

        cfg = load_config(args.config, args.set or [])
        notes = check_registry_options(cfg)
        print(dump_toml(cfg))
        for note in notes:
            print(f"deepfusion: note: {note}", file=sys.stderr)
    else:
        print(describe())
    return 0
