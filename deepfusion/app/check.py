"""``deepfusion check CONFIG --ranks P``: every check ``train`` makes at start-up for a job of P
ranks, in one process and without MPI, then a short measured probe of each level on this host.

The checks are ``train``'s own functions in ``train``'s order (``preflight.check_lock`` and
``check_run``, then ``build.build_checked``), run for the P ranks of the job being checked: a
step that depends on the rank (a rank's block of a domain split) runs for each distinct rank,
and a refusal is worded as ``train`` words it (``policy.raise_first``: the first failing rank),
so the message is the one the job would print after its queue wait. The refusals come before
the probe (:mod:`.probe`), which ``--no-probe`` skips. ``jobs render`` and ``jobs sweep`` call
:func:`check_launch` for the layout they write, with ``here=False``: the CPU, the lock and the
run directory of this host are not the job's.

Exit codes: 0 every check passed (warnings on stderr), 2 a refusal (:mod:`.policy`), 1 the
probe failed (its last lines are shown).
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

from deepfusion.config import load_config
from deepfusion.engine.errors import InputError
from deepfusion.engine.train.plan import plan
from deepfusion.app.policy import INPUT_ERRORS, ExitCode, raise_first, run_local
from deepfusion.app.preflight import (apply_resume, batch_warnings, check_batches, check_lock, check_run,
                        check_resumable, data_limit, data_units, useful_ranks_warning)

RANKS_HELP = ("the number of MPI ranks of the job to check (nodes x ranks per node): the "
              "batches, the domain split and the messages are those of a launch on P ranks")


def register(sub) -> None:
    p = sub.add_parser("check", help="every start-up check of 'deepfusion train' for P ranks, "
                                     "without training or MPI, plus a short measured probe "
                                     "(seconds per step and peak memory per rank of each level)")
    p.add_argument("config", nargs="?", default=None,
                   help="TOML config, as 'deepfusion train' takes it (with --resume, "
                        "RUN_DIR/config.toml if none is given)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config key, as 'deepfusion train --set' (repeatable)")
    p.add_argument("--ranks", type=int, required=True, metavar="P", help=RANKS_HELP)
    p.add_argument("--threads", type=int, default=None, metavar="T",
                   help="threads per rank (sets parallel.threads_per_rank; the probe runs with "
                        "them; default: the config's, 0 = this host's cores)")
    p.add_argument("--resume", metavar="RUN_DIR", help="check a 'train --resume RUN_DIR'")
    p.add_argument("--overwrite", action="store_true", help="check a 'train --overwrite'")
    p.add_argument("--no-probe", action="store_true",
                   help="only the checks: no measured steps (under 5 s)")
    p.add_argument("--probe-steps", type=int, default=3, metavar="N",
                   help="measured steps per level, after one warm-up step (default 3)")
    p.add_argument("--probe-timeout", type=float, default=900.0, metavar="S",
                   help="seconds before the probe is given up (a hang guard; default 900)")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    p.set_defaults(run=run)


def run(args) -> int:
    """A local command whose refusals are ``train``'s (InputError, worded per rank)."""
    try:
        return run_local(cmd_check, args)
    except InputError as e:
        print(f"deepfusion: error: {e}", file=sys.stderr, flush=True)
        return ExitCode.INPUT


def simulated(size: int, distinct: int = 1):
    """``build_checked``'s ``check`` for ``size`` ranks in this one process: a step runs once
    (``per_rank``: once per rank 0 .. distinct-1, the ranks whose answers can differ), and a
    refusal names the first failing rank as a real launch's does."""
    def check(fn, *args, per_rank=False):
        errors, out = [None] * size, None
        for r in range(min(size, distinct)) if per_rank else [0]:
            try:
                out = fn(*args, *([r] if per_rank else []))
            except INPUT_ERRORS as e:
                errors[r] = f"{e}"
                break
        raise_first(errors)
        return out
    return check


@dataclass(kw_only=True)
class Checked:
    """What passed: the config, the notes to show, and the facts of the launch."""

    cfg: object
    size: int
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def facts(self) -> dict:
        cfg, size = self.cfg, self.size
        levels = {}
        for v in plan(cfg):  # a level visited again (a cycle) adds its steps
            lv = levels.setdefault(v.level, {"level": v.level, "grid": list(v.grid),
                                             "global_batch": v.global_batch,
                                             "micro_batch": v.micro_batch, "steps": 0})
            lv["steps"] += v.steps
        units = data_units(cfg, size)
        for lv in levels.values():
            lv["per_unit"] = lv["global_batch"] // units
        return {"ranks": size, "units": units, "ranks_per_sample": cfg.parallel.blocks(),
                "threads_per_rank": cfg.parallel.threads_per_rank,
                "data_limit": data_limit(cfg), "levels": list(levels.values()),
                "max_useful_ranks": cfg.parallel.max_useful_ranks,
                "run_dir": cfg.run.dir, "notes": self.notes, "warnings": self.warnings}


def check_launch(config, sets, size: int, *, resume: bool = False, overwrite: bool = False,
                 here: bool = True) -> Checked:
    """Every start-up check of ``train`` on ``size`` ranks (InputError with ``train``'s message).
    ``here=False`` (a job for other nodes: ``jobs render``) leaves out what depends on this host:
    its CPU's precision, the run directory's lock and state."""
    if size < 1:
        raise ValueError(f"--ranks must be >= 1, got {size}")
    one = simulated(size)
    cfg = one(load_config, config, list(sets or []))
    done = Checked(cfg=cfg, size=size)
    if here:
        note = one(check_lock, cfg.run.dir, size)
        done.notes += [f"run directory {cfg.run.dir}: {note}"] if note else []
        one(check_run, cfg, size, resume, overwrite)
        if resume:   # train's own refusal, worded as train words it (not per rank)
            done.notes.append(f"resumes from {check_resumable(cfg.run.dir)}")
    else:
        one(check_batches, cfg, size)
    from deepfusion.app.build import build_checked, first_grid  # torch: after the checks
    from deepfusion.app.traps import instance_norm_warning       # that need none

    _, model, _, problems = build_checked(cfg, simulated(size, cfg.parallel.blocks()))
    past = useful_ranks_warning(cfg, size)
    trap = instance_norm_warning(cfg, problems(first_grid(cfg)), model)
    done.warnings += ([past] if past else []) + batch_warnings(cfg, size) + ([trap] if trap else [])
    return done


def cmd_check(args) -> int:
    if args.probe_steps < 1:
        raise ValueError(f"--probe-steps must be >= 1, got {args.probe_steps}")
    apply_resume(args)
    sets = list(args.set or [])
    if args.threads is not None:
        sets.append(f"parallel.threads_per_rank={args.threads}")
    done = check_launch(args.config, sets, args.ranks, resume=bool(args.resume),
                        overwrite=args.overwrite)
    report = done.facts()
    print(summary(report, args.config, args.resume, args.overwrite), flush=True)
    for w in done.warnings:
        print(f"deepfusion: warning: {w}", file=sys.stderr, flush=True)
    for n in done.notes:
        print(f"deepfusion: note: {n}", file=sys.stderr, flush=True)
    rc = ExitCode.OK
    if not args.no_probe:
        rc = probe_section(done, args, report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return rc


def probe_section(done: Checked, args, report: dict) -> int:
    """Run the probe, print its lines, add it to ``report``; 1 if it failed."""
    from deepfusion.app.probe import run_probe

    threads = done.cfg.parallel.threads_per_rank
    try:
        report["probe"] = run_probe(done.cfg, done.size, threads, args.probe_steps,
                                    args.probe_timeout)
    except ValueError as e:
        report["probe"] = {"error": str(e)}
        print(f"deepfusion: error: {e}", file=sys.stderr, flush=True)
        return ExitCode.ABORT
    print(probe_text(report), flush=True)
    return ExitCode.OK


def summary(r: dict, config, resume, overwrite) -> str:
    """The lines of a launch that passed."""
    d = r["ranks_per_sample"]
    split = f" x {d} ranks per sample (parallel.domain)" if d > 1 else ""
    threads = r["threads_per_rank"] or "auto (cores on the node / ranks on the node)"
    state = "resumed (--resume)" if resume else "replaced (--overwrite)" if overwrite else "new"
    lines = [f"{config or 'the run directory config'} on {r['ranks']} rank(s): passed every "
             f"start-up check of deepfusion train",
             f"  ranks: {r['ranks']} = {r['units']} data-parallel unit(s){split}; threads per "
             f"rank: {threads}"]
    for lv in r["levels"]:
        micro = f", micro-batch {lv['micro_batch']}" if lv["micro_batch"] > 0 else ""
        lines.append(f"  level {lv['level']} ({'x'.join(map(str, lv['grid']))}): global batch "
                     f"{lv['global_batch']} = {lv['per_unit']} per unit{micro}, "
                     f"{lv['steps']} step(s)")
    lines.append(useful_line(r))
    lines.append(f"  run directory {r['run_dir']}: {state}")
    return "\n".join(lines)


def useful_line(r: dict) -> str:
    """The largest useful rank count: ``parallel.max_useful_ranks`` where the config states
    one within the data-parallel limit, else that limit (what the batches allow at all)."""
    d, limit, stated = r["ranks_per_sample"], r["data_limit"], r["max_useful_ranks"]
    per = f" x {d} ranks per sample" if d > 1 else ""
    allow = (f"{limit // d} data-parallel units{per}: every level's global batch splits evenly "
             f"over them")
    if not stated:
        return f"  largest useful rank count: {limit} ({allow})"
    if stated > limit:
        return (f"  largest useful rank count: {limit} ({allow}; parallel.max_useful_ranks = "
                f"{stated} is past what these batches allow)")
    if stated == limit:
        return f"  largest useful rank count: {limit} (parallel.max_useful_ranks; {allow})"
    return (f"  largest useful rank count: {stated} (parallel.max_useful_ranks); the batches "
            f"allow up to {limit}")


def probe_text(r: dict) -> str:
    """The probe's lines: what was measured, where, and per level."""
    p = r["probe"]
    who = (f"one data-parallel unit's share of the batch ({p['ranks']} ranks, run here as "
           f"{p['ranks']} local processes)" if p["ranks"] > 1 else "one rank's share of the batch")
    lines = [f"probe: {p['steps']} measured step(s) per level after {p['warmup']} warm-up, "
             f"{who}, on this host ({p['host']}, {p['threads']} "
             f"thread(s) per rank, {p['precision']}); another CPU's speed differs, and "
             f"communication between units is not included"]
    total = 0.0
    steps = {lv["level"]: lv["steps"] for lv in r["levels"]}
    for lv in p["levels"]:
        t = lv["median_step_s"]
        total += t * steps.get(lv["level"], 0)
        grow = lv["cache_full_mib"] - lv["cache_mib"]
        lines.append(f"  level {lv['level']} ({'x'.join(map(str, lv['grid']))}): batch "
                     f"{lv['local_batch']} per unit: {t:.3g} s/step (median), peak "
                     f"{lv['peak_mib']:.0f} MiB per rank"
                     + (f" (+{grow:.0f} MiB once the input cache holds the whole pool)"
                        if grow >= 1 else ""))
    lines.append(f"  at these speeds: {duration(total)} of steps for the whole plan "
                 f"({sum(steps.values())} steps; evaluation and checkpoints not included)")
    if not p["peak_reset"]:
        lines.append("  (this kernel does not reset the peak memory: each level's peak is "
                     "the process's peak so far)")
    return "\n".join(lines)


def duration(seconds: float) -> str:
    """``seconds`` as 42 s, 12.5 min or 3.2 h."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 3600 else f"{seconds / 3600:.1f} h"
