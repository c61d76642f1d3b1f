"""The checks of a launch that need neither torch nor the network: the batch of every level
against the number of ranks (or domain groups), the precision against this CPU, and the run
directory's state (and, for ``deepfusion check``, its lock, looked at without taking it).

``deepfusion train`` runs them on every rank right after reading the config, before torch is
imported: a refused launch (a batch P does not divide, a run directory that already holds a
run) exits in a fraction of a second instead of after each rank's imports (seconds). The checks
that need the problem and the network follow in ``build``; nothing is written until all pass.
"""
from __future__ import annotations

import glob
import math
import os
import shutil
import tempfile
import time

from deepfusion.config import stated
from deepfusion.engine.parallel.data import check_divisible, group_count
from deepfusion.engine.parallel.layout import check_precision
from deepfusion.engine.run import hook
from deepfusion.engine.run import lock as runlock
from deepfusion.engine.run.files import check_overwrite
from deepfusion.engine.train.plan import plan


def holds_run(d: str) -> bool:
    """Whether directory ``d`` holds a run (its metrics or its checkpoints folder)."""
    return os.path.exists(os.path.join(d, "metrics.jsonl")) or os.path.isdir(os.path.join(d, "checkpoints"))


def check_run(cfg, size: int, resume: bool, overwrite: bool) -> None:
    """Everything about this launch that is not the model: ranks, CPU, run directory, and the
    test-only hook (a malformed one is refused here, not at the first step)."""
    hook.load(0)
    check_batches(cfg, size)
    check_precision(cfg.train.precision)
    check_run_dir(cfg.run.dir, resume, overwrite)


def check_batches(cfg, size: int) -> None:
    """Every level's global batch against the data-parallel units ``size`` ranks make."""
    units = data_units(cfg, size)
    for v in plan(cfg):
        try:
            check_divisible(v.global_batch, units)
        except ValueError as e:
            if units != size:
                e = ValueError(f"{e} (here P is the number of data-parallel groups: {size} ranks "
                               f"/ {cfg.parallel.blocks()} blocks per sample)")
            if not cfg.train.levels:
                raise e from None
            raise ValueError(f"train.levels[{v.level}] (grid {list(v.grid)}): {e}") from None


def check_run_dir(d: str, resume: bool, overwrite: bool) -> None:
    """The run directory's state against --resume / --overwrite."""
    if resume and not holds_run(d):
        raise ValueError(f"--resume {d}: no run there (no metrics.jsonl or checkpoints/)")
    if holds_run(d) and not resume and not overwrite:
        raise ValueError(f"run directory {d!r} already holds a run. Continue it with --resume {d}, "
                         f"start over with --overwrite, or choose another with --set run.dir=PATH")
    if holds_run(d) and overwrite and not resume:
        check_overwrite(d)
    check_writable(d)


MIN_FREE = 64 << 20   # bytes a run directory needs free at least, whatever its checkpoints


def check_writable(d: str) -> None:
    """ValueError unless the run directory (where it exists) and its checkpoints/ accept a new
    file and have room for a few checkpoints: a read-only or full directory is refused at the
    start, not at the first checkpoint after hours of training."""
    for where in (d, os.path.join(d, "checkpoints")):
        if not os.path.isdir(where):
            continue
        try:
            fd, probe = tempfile.mkstemp(prefix=".write-probe.", dir=where)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise ValueError(f"cannot write in {where}: {e.strerror or e}. The run needs to write "
                             f"its metrics and checkpoints there: make it writable (chmod u+w "
                             f"{where}) or choose another directory with --set run.dir=PATH") from None
    check_replaceable(d)
    if os.path.isdir(d):
        need = max(MIN_FREE, 3 * newest_checkpoint_size(d))
        free = shutil.disk_usage(d).free
        if free < need:
            raise ValueError(f"{d} has {free / 2**20:.0f} MB free, less than the {need / 2**20:.0f} "
                             f"MB its checkpoints need (three times the newest one, at least "
                             f"{MIN_FREE >> 20} MB): free some space or choose another directory "
                             f"with --set run.dir=PATH")


# the run's files that a resume rewrites in place (by a temporary file renamed onto them)
REWRITTEN = ("metrics.jsonl", "config.toml")


def check_replaceable(d: str) -> None:
    """ValueError where a file the run rewrites is not a file it can replace (a directory, an
    immutable or read-only file): said at the start, not as a traceback at its first write."""
    for name in REWRITTEN:
        p = os.path.join(d, name)
        if not os.path.lexists(p):
            continue
        if not os.path.isfile(p) or os.path.islink(p):
            raise ValueError(f"{p} is not a regular file: the run writes its records there. "
                             f"Move it out of the way, or choose another directory with "
                             f"--set run.dir=PATH")
        if not os.access(p, os.W_OK):
            raise ValueError(f"cannot replace {p}: it is read-only or immutable, and the run "
                             f"rewrites it. Make it writable (chmod u+w, chattr -i) or choose "
                             f"another directory with --set run.dir=PATH")


def newest_checkpoint_size(d: str) -> int:
    ckpts = glob.glob(os.path.join(d, "checkpoints", "step_*.h5"))
    return max((os.path.getsize(p) for p in ckpts), default=0)


def check_lock(run_dir: str, ranks: int) -> str:
    """What ``train`` would find in the run directory's lock, without taking it:
    ``RunDirInUse`` (train's message) while a live job holds it; a note when a stale lock
    would be taken over; "" when there is none."""
    raw, mtime = runlock.read_lock(os.path.join(run_dir, runlock.LOCK_NAME))
    if raw is None:
        return ""
    holder, now = runlock.Holder.parse(raw), time.time()
    why = runlock.stale_reason(holder, mtime, runlock.Holder.here(ranks=ranks, command=""), now)
    if why:
        return f"a stale lock, which train takes over: {why}"
    if holder is None:
        return "a lock being written right now"
    raise runlock.RunDirInUse(runlock.refusal(run_dir, holder, now))


def check_resumable(run_dir: str) -> str:
    """The checkpoint ``train --resume run_dir`` would start from (the newest that loads:
    every newer one is read and refused first, as train does), or InputError with train's
    message when none loads. Imports torch: after the checks that need none."""
    from deepfusion.engine.run.resume import newest_loadable

    return newest_loadable(run_dir)


def apply_resume(args) -> None:
    """``--resume RUN_DIR``: the run directory's own config unless one is given (a requeued
    job), and ``run.dir`` set to RUN_DIR. ValueError for options that contradict it."""
    if args.resume and getattr(args, "overwrite", False):
        raise ValueError(f"--resume {args.resume} continues the run there and --overwrite "
                         f"starts it over: give one of them")
    if args.resume:
        named = False       # a --set run.dir (a job script's) names the directory itself
        for item in args.set or []:
            key, _, value = str(item).partition("=")
            other = value.strip().strip("'\"")
            named = named or key.strip() == "run.dir"
            if key.strip() == "run.dir" and os.path.abspath(other) != os.path.abspath(args.resume):
                raise ValueError(f"--resume {args.resume} continues the run in {args.resume}, "
                                 f"but --set {item} names another directory. To continue it "
                                 f"there, drop --set run.dir; to start a new run from its "
                                 f"weights, use --set model.init_from=CHECKPOINT with "
                                 f"--set run.dir={other}")
        if args.config is None:
            args.config = os.path.join(args.resume, "config.toml")
        elif not named:
            refuse_other_dir(args.config, args.resume)
        args.set = list(args.set or []) + [f"run.dir={args.resume}"]


def refuse_other_dir(config: str, resume: str) -> None:
    """ValueError where ``config`` states a run.dir other than the ``--resume`` directory:
    which run was meant is not clear (a requeued job gives its run's own config)."""
    where = stated(config, "run", "dir")
    if isinstance(where, str) and os.path.abspath(where) != os.path.abspath(resume):
        raise ValueError(f"--resume {resume} continues the run in {resume}, but {config} "
                         f"names run.dir = {where!r}. To continue {resume}, give its own "
                         f"config ({os.path.join(resume, 'config.toml')}), none, or --set "
                         f"run.dir={resume}; to start a new run in {where}, drop --resume")


def data_units(cfg, size: int) -> int:
    """How many data-parallel units ``size`` ranks make: the ranks, or under parallel.domain
    the groups of prod(domain) ranks (ValueError if they do not divide evenly)."""
    return group_count(size, cfg.parallel.domain) if cfg.parallel.domain else size


def data_limit(cfg) -> int:
    """The largest rank count every level's global batch allows: the batches' greatest
    common divisor, times the ranks that share a sample under ``parallel.domain``."""
    return math.gcd(*(v.global_batch for v in plan(cfg))) * cfg.parallel.blocks()


def useful_ranks_warning(cfg, size: int) -> str:
    """The warning of a launch on more ranks than ``parallel.max_useful_ranks`` ("" within it,
    or when the config states no limit): valid, but the ranks past it add cost, not speed."""
    limit = cfg.parallel.max_useful_ranks
    if not limit or size <= limit:
        return ""
    return (f"{size} ranks is past parallel.max_useful_ranks = {limit}, past which this "
            f"config's time to its accuracy stops falling: the extra ranks cost core-hours "
            f"without shortening the run. Run on {limit} ranks or fewer; for more, enlarge "
            f"the global batch (data.global_batch, each train.levels[i].global_batch) or "
            f"split every sample over ranks (parallel.domain), and set "
            f"parallel.max_useful_ranks to that variant's limit")


def batch_warnings(cfg, size: int) -> list[str]:
    """A level where ``size`` ranks leave one sample per data-parallel unit: the launch is
    valid but at the data-parallel limit there, so more ranks cannot help that level."""
    units = data_units(cfg, size)
    out = []
    for v in {v.level: v for v in plan(cfg)}.values():  # a cycle visits a level again
        if v.global_batch == units:
            where = f"train.levels[{v.level}] (grid {list(v.grid)})" if cfg.train.levels \
                else "data.global_batch"
            out.append(f"{where}: global batch {v.global_batch} on {units} data-parallel "
                       f"unit(s) is 1 sample each: the data-parallel limit of this level; "
                       f"more ranks need a larger global batch there (or parallel.domain)")
    return out
