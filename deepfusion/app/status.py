"""``deepfusion status RUN_DIR`` and ``deepfusion plot RUN_DIR``: watching a run, running or
finished, from what its run directory holds. Both only read the directory (``plot`` writes its
figure), so they are safe beside a live job, on a login node, on any file system.

``status`` reads ``config.toml`` (the problem, the grids and the plan's total steps),
``metrics.jsonl`` as it is (:func:`~deepfusion.engine.run.log.read_metrics`: a line being
written is skipped) for the last step, loss, elapsed time, ETA and validation, the newest
checkpoint that passes its check (:func:`~deepfusion.engine.checkpoint.store.find_checkpoint`; newer
ones it skipped are named, with why), and ``lock.json`` judged exactly as the next ``train``
would judge it (:func:`~deepfusion.engine.run.lock.stale_reason`): running, finished, stopped
(resume it) or a stale lock. ``--json`` prints the same as one JSON object.

``plot`` draws :func:`~deepfusion.engine.run.log.plot_loss_curve` (the figure a run writes to
``loss.png`` at its end) to ``RUN_DIR/progress.png`` by default, never over the run's own
``loss.png``; ``--out`` chooses another file. One process, no MPI; a directory that is not a
run directory is bad input (exit 2, :mod:`.policy`).
"""
from __future__ import annotations

import json
import os
import re
import time

from deepfusion.config import load_config
from deepfusion.engine.run import lock as runlock
from deepfusion.engine.run.eta import eta_text, format_duration
from deepfusion.engine.train.budget import UNDECIDED
from deepfusion.engine.train.plan import plan, visit_at
from deepfusion.engine.run.log import plot_loss_curve, read_metrics
from deepfusion.app.policy import run_local

MARKS = ("config.toml", "metrics.jsonl", "checkpoints", runlock.LOCK_NAME)  # what a run leaves
STEP_FILE = re.compile(r"^step_(\d+)\.h5$")
FIGURE = "progress.png"  # plot's default: the run writes loss.png itself at its end
FORMATS = ("png", "pdf", "svg")


def register(sub) -> None:
    s = sub.add_parser("status", help="summarise a run directory: step, loss, validation, "
                                      "newest checkpoint, ETA, and whether a job is running")
    s.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (a train's run.dir)")
    s.add_argument("--json", action="store_true", help="print one JSON object instead")
    s.set_defaults(run=lambda args: run_local(cmd_status, args))
    p = sub.add_parser("plot", help="draw a run's loss and validation curves, running or "
                                    "finished")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (a train's run.dir)")
    p.add_argument("--out", metavar="FILE.png",
                   help=f"the figure (.png, .pdf or .svg; default RUN_DIR/{FIGURE}, never the "
                        f"loss.png the run writes at its end)")
    p.set_defaults(run=lambda args: run_local(cmd_plot, args))


def require_run_dir(run_dir: str) -> None:
    if not os.path.isdir(run_dir):
        raise ValueError(f"{run_dir!r} is not a directory: give a run directory (the run.dir "
                         f"of a deepfusion train, e.g. runs/demo)")
    if not any(os.path.exists(os.path.join(run_dir, m)) for m in MARKS):
        raise ValueError(f"{run_dir!r} is not a run directory: it holds none of "
                         f"{', '.join(MARKS)} (a deepfusion train writes them to its run.dir, "
                         f"e.g. runs/demo)")


# -- what the directory holds ------------------------------------------------------------------

def read_plan(run_dir: str, notes: list) -> tuple[dict, list]:
    """(the problem's name and options, the plan's visits) from config.toml; ({}, []) with a
    note when it is missing or no longer valid."""
    path = os.path.join(run_dir, "config.toml")
    if not os.path.exists(path):
        notes.append(f"no {path}: the problem and the total steps are unknown")
        return {}, []
    try:
        cfg = load_config(path)
        return {"name": cfg.problem.name, "options": dict(cfg.problem.options)}, plan(cfg)
    except (ValueError, KeyError, TypeError, OSError) as e:
        notes.append(f"{path} cannot be read ({e}): the total steps are unknown")
        return {}, []


def newest_checkpoint(run_dir: str, notes: list) -> tuple[dict | None, list[str]]:
    """({path, step} of the newest checkpoint that passes its check, or None; the newer ones
    skipped, each with why)."""
    from deepfusion.engine.checkpoint.store import find_checkpoint  # (imports torch and h5py)

    path, skipped = find_checkpoint(run_dir, notes)
    if path is None:
        return None, skipped
    m = STEP_FILE.match(os.path.basename(path))
    return {"path": path, "step": int(m.group(1)) if m else None}, skipped


def lock_state(run_dir: str) -> dict | None:
    """The lock's holder and whether it is stale, judged as a start would; None if no lock."""
    path = os.path.join(run_dir, runlock.LOCK_NAME)
    raw, mtime = runlock.read_lock(path)
    if raw is None:
        return None
    now, holder = time.time(), runlock.Holder.parse(raw)
    me = runlock.Holder.here(ranks=0, command="deepfusion status")
    stale = runlock.stale_reason(holder, mtime, me, now)
    if holder is None:
        return {"readable": False, "changed_s_ago": now - mtime, "stale": stale}
    return {"readable": True, "host": holder.host, "pid": holder.pid,
            "slurm_job": holder.slurm_job, "ranks": holder.ranks, "command": holder.command,
            "started": holder.started, "heartbeat_s_ago": max(0.0, now - holder.heartbeat),
            "stale": stale}


def last_of(recs: list[dict], kind: str) -> dict | None:
    return next((r for r in reversed(recs) if r["kind"] == kind), None)


def validation(rec: dict | None) -> dict | None:
    """{what, mean, median, worst} of an eval record or eval.json, None if it has none."""
    for key, what in (("rel_l2", "rel L2"), ("loss", "loss")):
        if rec is not None and f"{key}_mean" in rec:
            return {"what": what, "mean": rec[f"{key}_mean"], "median": rec[f"{key}_median"],
                    "worst": rec[f"{key}_max"], "step": rec.get("step"), "grid": rec.get("grid"),
                    "n": rec.get("n")}
    return None


def final_validation(run_dir: str) -> dict | None:
    try:
        with open(os.path.join(run_dir, "eval.json")) as f:
            return validation(json.load(f))
    except (OSError, ValueError):
        return None


def summarise(run_dir: str) -> dict:
    """Everything ``status`` reports, as plain data (the ``--json`` output)."""
    require_run_dir(run_dir)
    notes: list[str] = []
    problem, visits = read_plan(run_dir, notes)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    recs = read_metrics(metrics) if os.path.exists(metrics) else []
    last, ev = last_of(recs, "step"), last_of(recs, "eval")
    ckpt, skipped = newest_checkpoint(run_dir, notes)
    step = max((last or {}).get("step", 0), (ckpt or {}).get("step") or 0)
    total = visits[-1].end if visits else None
    if total is not None and total >= UNDECIDED:  # a time budget's: decided by the run, if yet
        total = (last_of(recs, "time_budget") or {}).get("steps")
    visit = visit_at(visits, max(0, step - 1)) if visits else None
    out = {"run_dir": run_dir, "problem": problem,
           "grids": [list(v.grid) for v in visits], "step": step, "total_steps": total,
           "level": visit.level if visit else (last or {}).get("level"),
           "grid": list(visit.grid) if visit else (last or {}).get("grid"),
           "visit": visit.index if visit else None, "visits": len(visits),
           "loss": (last or {}).get("loss"), "terms": (last or {}).get("terms", {}),
           "validation": validation(ev), "checkpoint": ckpt, "skipped_checkpoints": skipped}
    for key in ("elapsed_s", "segment_s", "eta_s", "eta_scaled"):
        out[key] = (last or {}).get(key)
    out["last_record_s_ago"] = time.time() - os.path.getmtime(metrics) if recs else None
    out["lock"] = lock_state(run_dir)
    out["state"], out["state_text"] = run_state(out)
    out["final_validation"] = final_validation(run_dir) if out["state"] == "finished" else None
    out["notes"] = notes
    return out


# -- the verdict ---------------------------------------------------------------------------------

def holder_text(lock: dict) -> str:
    job = f", Slurm job {lock['slurm_job']}" if lock["slurm_job"] else ""
    return f"PID {lock['pid']} on host {lock['host']}{job}, heartbeat " \
           f"{lock['heartbeat_s_ago']:.0f} s ago"


def run_state(s: dict) -> tuple[str, str]:
    """(running | damaged lock | finished | stopped | stale lock | not started, the sentence
    status prints)."""
    lock, step, total, ckpt = s["lock"], s["step"], s["total_steps"], s["checkpoint"]
    if lock is not None and not lock["stale"]:
        if not lock["readable"] and lock["changed_s_ago"] < runlock.WRITING_S:
            return "running", "running (its lock.json is being written)"
        if not lock["readable"]:
            return "damaged lock", (f"unknown: lock.json is damaged (no lock record, changed "
                                    f"{lock['changed_s_ago']:.0f} s ago); a live job repairs "
                                    f"it within {runlock.DAMAGED_S:.0f} s, else the next "
                                    f"start takes it over")
        return "running", f"running ({holder_text(lock)})"
    saved = ckpt["step"] if ckpt else None
    if total is not None and step >= total and saved is not None and saved >= total:
        state, text = "finished", f"finished: step {step} of {total}"
    elif step == 0 and ckpt is None:
        state, text = "not started", "not started: no step taken yet"
    else:
        resume = f"deepfusion train --resume {s['run_dir']}"
        if ckpt is None:
            again = f"deepfusion train {os.path.join(s['run_dir'], 'config.toml')} --overwrite"
            text = f"stopped at step {step}, with no complete checkpoint: start over with {again}"
        else:
            text = f"stopped at step {step}: resume with {resume}"
            if saved is not None and saved < step:
                text += f" (it continues from step {saved}, the newest complete checkpoint)"
        state = "stopped"
    if lock is not None:  # stale: the next start takes it over
        who = holder_text(lock) if lock["readable"] else "a damaged lock.json"
        return "stale lock", f"stale lock ({who}: {lock['stale']}): not running, {text}"
    return state, f"not running ({text})"


# -- the commands ----------------------------------------------------------------------------------

def fmt_grid(grid) -> str:
    return "x".join(map(str, grid)) if grid else "?"


def validation_text(v: dict) -> str:
    where = f" at step {v['step']} ({fmt_grid(v['grid'])})" if v.get("step") is not None else ""
    draws = f" over {v['n']} draws" if v.get("n") else ""
    return (f"{v['what']} mean {v['mean']:.4g} median {v['median']:.4g} worst "
            f"{v['worst']:.4g}{draws}{where}")


def report(s: dict) -> str:
    """The summary as the lines ``status`` prints."""
    grids = " -> ".join(fmt_grid(g) for g in s["grids"]) or "?"
    total = s["total_steps"] if s["total_steps"] is not None else "?"
    level = "" if s["visits"] <= 1 else (f", level {s['level']}, visit {s['visit'] + 1} of "
                                         f"{s['visits']}")
    rows = [("run", f"{s['run_dir']}: {s['problem'].get('name', '?')} on {grids}"),
            ("state", s["state_text"]),
            ("step", f"{s['step']}/{total} ({fmt_grid(s['grid'])}{level})")]
    if s["loss"] is not None:
        terms = "".join(f", {k} {v:.4e}" for k, v in s["terms"].items())
        rows.append(("loss", f"{s['loss']:.4e}{terms}"))
    if s["validation"]:
        rows.append(("validation", validation_text(s["validation"])))
    if s["final_validation"]:
        rows.append(("final", f"{validation_text(s['final_validation'])} (eval.json)"))
    c = s["checkpoint"]
    rows.append(("checkpoint", f"{c['path']} (step {c['step']})" if c else "none complete"))
    rows += [("  skipped", why) for why in s["skipped_checkpoints"]]
    if s["elapsed_s"] is not None:
        rows.append(("time", time_text(s)))
    rows += [("note", n) for n in s["notes"]]
    return "\n".join(f"{k:<10} {v}" for k, v in rows)


def time_text(s: dict) -> str:
    """Elapsed (the run's, over its resumed segments, and this segment's) and the ETA, as of
    the last step record."""
    seg = (f" (this segment {format_duration(s['segment_s'])})"
           if s["segment_s"] is not None else "")
    ago = (f", logged {s['last_record_s_ago']:.0f} s ago"
           if s["last_record_s_ago"] is not None else "")
    eta = ""
    if s["state"] != "finished":
        eta = f", eta {eta_text(s['eta_s'], s['eta_scaled'])}" + (
            " (~: the levels not yet run are estimated)" if s["eta_scaled"] else "")
    return f"elapsed {format_duration(s['elapsed_s'])}{seg}{eta} as of step {s['step']}{ago}"


def cmd_status(args) -> int:
    s = summarise(args.run_dir)
    print(json.dumps(s, indent=1) if args.json else report(s), flush=True)
    return 0


def cmd_plot(args) -> int:
    require_run_dir(args.run_dir)
    metrics = os.path.join(args.run_dir, "metrics.jsonl")
    recs = read_metrics(metrics) if os.path.exists(metrics) else []
    last = last_of(recs, "step")
    if last is None:
        raise ValueError(f"{metrics} holds no step yet: nothing to plot (a run logs every step "
                         f"to it; try again once its first step is done)")
    out = args.out or os.path.join(args.run_dir, FIGURE)
    fmt = os.path.splitext(out)[1].lstrip(".").lower()
    if fmt not in FORMATS:
        endings = ", ".join("." + f for f in FORMATS)
        raise ValueError(f"--out {out}: give a file ending in {endings}")
    _, visits = read_plan(args.run_dir, [])
    total = f"/{visits[-1].end}" if visits else ""
    plot_loss_curve(metrics, out, title=f"{args.run_dir}: step {last['step']}{total}")
    print(f"{out}: loss and validation curves of {args.run_dir} to step {last['step']}{total}",
          flush=True)
    return 0
