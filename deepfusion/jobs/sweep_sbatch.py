"""``jobs sweep --sbatch``: each layout as its own batch job, rendered as ``jobs render`` writes
it, submitted, waited for; and the profile those scripts are rendered from (``--partition`` and
``--account`` over its fields, placeholders refused).
"""
from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

from deepfusion.jobs.precheck import refuse_placeholders, with_site
from deepfusion.jobs.profiles import get_profile, load_profiles
from deepfusion.jobs.render import render
from deepfusion.jobs.slurm import FINAL_STATES, SlurmError, job_info, sbatch


def site_profiles(args) -> dict:
    """The profiles with --partition / --account over the cluster's (a partition or account
    given in --sbatch-args leaves its #SBATCH line out: sbatch's own option wins); ValueError
    if a placeholder is left."""
    profs = load_profiles(args.profiles)
    given = shlex.split(args.sbatch_args)
    site = {}
    for key, short in (("partition", "-p"), ("account", "-A")):
        flag = getattr(args, key)
        site[key] = flag if flag is not None else "" if passes(given, short, f"--{key}") else None
    prof = with_site(get_profile(args.cluster, profs), **site)
    refuse_placeholders(prof)
    profs[args.cluster] = prof
    return profs


def passes(tokens: list[str], short: str, long: str) -> bool:
    """Whether sbatch options ``tokens`` give the option ``short`` / ``long`` (-pX, -p X,
    --partition=X, --partition X)."""
    return any(a == long or a.startswith(long + "=") or a.startswith(short) for a in tokens)


def submit_layouts(args, plan, sets) -> list[dict]:
    """--sbatch: one batch job per layout of ``plan`` (its ``--set`` items in ``sets``, in the
    same order), rendered exactly as `jobs render` would for the cluster (its #SBATCH layout,
    binding and launcher), all submitted first, then polled together (a job that finished early
    is read before Slurm forgets it, MinJobAge); they run concurrently where the partition has
    room. Status "ok" means Slurm's COMPLETED; --timeout is per layout."""
    train = args.deepfusion or f"{shlex.quote(sys.executable)} -m deepfusion"
    config = str(Path(args.config).resolve())
    jobs, status, profiles = [], {}, site_profiles(args)

    def cancel(jids, reason):  # a failed sweep or a hung layout must not leave jobs queued
        for jid in jids:
            subprocess.run(["scancel", str(jid)], capture_output=True, timeout=30)
            print(f"[sweep] cancelled job {jid} ({reason})", flush=True)

    try:
        for (r, t, gb, rd), extra in zip(plan, sets):
            (rd / "stdout.log").unlink(missing_ok=True)  # the script's --open-mode=append would mix runs
            script = rd / "job.sh"
            script.write_text(render(args.cluster, args.nodes, r, t, time=args.time, config=config,
                                     run_dir=str(rd.resolve()), job_name=f"sweep-{args.nodes}n{r}x{t}",
                                     profiles=profiles, deepfusion=train, extra_sets=tuple(extra)))
            jid = sbatch(script, "-o", str((rd / "stdout.log").resolve()), *shlex.split(args.sbatch_args), cwd=rd)
            print(f"[sweep] {r}x{t} global_batch={gb}: submitted job {jid} ({script})", flush=True)
            jobs.append((r, t, gb, rd, jid))
        deadline = time.monotonic() + args.timeout * len(jobs)
        while len(status) < len(jobs) and time.monotonic() < deadline:
            for r, t, _, _, jid in jobs:
                if jid in status:
                    continue
                info = job_info(jid)
                if info["JobState"] in FINAL_STATES:
                    status[jid] = "ok" if info["JobState"] == "COMPLETED" else \
                        f"slurm {info['JobState']} exit {info['ExitCode']}"
                    print(f"[sweep] {r}x{t} job {jid}: {status[jid]}", flush=True)
            time.sleep(0 if len(status) == len(jobs) else 2)
        late = [jid for *_, jid in jobs if jid not in status]
        cancel(late, f"not finished after {args.timeout * len(jobs):.0f} s")
        status.update({jid: "timeout" for jid in late})
    except SlurmError as exc:
        cancel([jid for *_, jid in jobs if jid not in status], "the sweep failed")
        raise ValueError(str(exc)) from None
    except BaseException:
        cancel([jid for *_, jid in jobs if jid not in status], "the sweep was interrupted")
        raise
    return [dict(nodes=args.nodes, ranks=r, threads=t, global_batch=gb, metrics=rd / "metrics.jsonl",
                 status=status[jid], command=f"sbatch {args.sbatch_args} {rd / 'job.sh'} (job {jid})")
            for r, t, gb, rd, jid in jobs]
