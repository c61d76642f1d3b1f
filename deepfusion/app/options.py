"""The flags ``evaluate``, ``infer`` and ``solve`` share: ``--set problem.options.KEY=VALUE``,
``--threads``, ``--samples``, and the deprecated spellings they replace.

``--set`` reads its VALUE as TOML, with the parser of ``deepfusion train --set``
(:func:`deepfusion.config.apply_overrides`), and on these commands takes only the keys of the
run's ``[problem.options]`` table. The old spellings (``--option KEY=VALUE`` with a JSON value,
``--sample N``) still work for one release, hidden from ``--help``; :func:`deprecated_spellings`
turns them into the new ones and returns one warning per spelling, which the command prints
once (rank 0). Kept light: no torch, no PDE.
"""
from __future__ import annotations

import argparse
import json

from deepfusion.config import apply_overrides
from deepfusion.config.schema import toml_value

PREFIX = "problem.options."

SET_HELP = ("a problem option, problem.options.KEY=VALUE, VALUE in TOML as in 'deepfusion "
            "train --set' (repeatable; 'deepfusion problems NAME' lists a problem's options)")
ANSWER_SET_HELP = (SET_HELP + ": replaces the checkpoint's option KEY (as in the "
                   "[problem.options] table of the run's config.toml), e.g. "
                   "problem.options.ritz_partition=2 changes how the answer is formed from the "
                   "network's output; refused if it changes the channels the network was "
                   "built for")
SOLVE_SET_HELP = (SET_HELP + ", e.g. problem.options.n_terms=6, "
                  "problem.options.omega_range=[-2, 2], problem.options.family=fine-scale")
THREADS_HELP = ("threads per rank (default 0 = auto: the host's cores / ranks); --threads 1 "
                "makes infer's output bytes identical for any number of ranks (more threads "
                "are faster but change the last float32 bits of predictions)")


def add_set(p, help_text: str) -> None:
    """``--set problem.options.KEY=VALUE`` and the hidden ``--option KEY=VALUE`` (JSON)."""
    p.add_argument("--set", action="append", metavar="problem.options.KEY=VALUE", help=help_text)
    p.add_argument("--option", action="append", metavar="KEY=VALUE", help=argparse.SUPPRESS)


def add_threads(p) -> None:
    p.add_argument("--threads", type=int, default=0, metavar="T", help=THREADS_HELP)


def parse_options(items) -> dict:
    """The deprecated ``--option`` pairs: ['key=value', ...] -> dict, values parsed as JSON
    when possible, else kept as strings."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--option must look like KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def set_options(items, command: str) -> dict:
    """The ``--set problem.options.KEY=VALUE`` items -> {KEY: value} (VALUE parsed as TOML, a
    dotted KEY below it makes a nested table). ValueError for any other key, naming the ones
    accepted."""
    for item in items or []:
        key = str(item).partition("=")[0].strip()
        if not key.startswith(PREFIX) or key == PREFIX or "=" not in str(item):
            raise ValueError(
                f"--set {item}: {command} takes only problem options, --set "
                f"problem.options.KEY=VALUE (KEY as in the [problem.options] table of the run's "
                f"config.toml; VALUE in TOML){_GRID_HINT if key.endswith('grid') else ''}")
    raw = apply_overrides({}, list(items or []))
    return dict(raw.get("problem", {}).get("options", {}))


_GRID_HINT = "; the grid is --grid HxW"


def problem_options(args, command: str) -> dict:
    """The problem options of ``--option`` (deprecated) then ``--set`` (the later wins)."""
    return {**parse_options(args.option), **set_options(args.set, command)}


def as_set_flags(options: dict) -> str:
    """``--set problem.options.K=V ...`` of ``options`` (V in TOML), for messages."""
    return " ".join(f"--set {PREFIX}{k}={toml_value(v)}" for k, v in options.items())


def deprecated_spellings(args) -> list[str]:
    """Move the old spellings on ``args`` to the new ones; one warning per old spelling used.
    ValueError when both spellings of one flag are given."""
    warns = []
    old = getattr(args, "sample", None)
    if old is not None:
        if getattr(args, "samples", None) is not None:
            raise ValueError("give --samples N once (--sample is its old spelling)")
        args.samples = old
        warns.append(f"deepfusion: WARNING: --sample is deprecated and will be removed in the "
                     f"next release: use --samples {old}")
    if getattr(args, "option", None):
        try:
            new = as_set_flags(parse_options(args.option))
        except ValueError:
            new = " ".join(f"--set {PREFIX}{item.strip()}" for item in args.option)
        warns.append(f"deepfusion: WARNING: --option KEY=VALUE is deprecated and will be removed "
                     f"in the next release: use --set {PREFIX}KEY=VALUE (VALUE in TOML), "
                     f"here {new}")
    return warns
