"""Time to accuracy against the global batch: train each family at several global batches under
several learning-rate rules for the same sample budget, then report steps and samples to a
validation target, the final test error and the critical batch.

    python -m lab.tools.batch_study run PLAN [--ranks 2] [--minutes 150] [--only ARM ...]
    python -m lab.tools.batch_study report PLAN [--target FAMILY=ERR ...] [--out FILE.json]
                                                [--raw FILE.json]
    python -m lab.tools.batch_study arms PLAN          # the arms and their overrides

PLAN (lab/configs/batch_study.toml) names the batches, the rules and, per family, a base
config with its batch-16 learning rate, a sample budget and a validation target. An arm is
(family, batch, rule), one run directory ``runs_dir/FAMILY_bB_RULE``. Rules:

* ``sqrt``: Adam, lr = lr16 * sqrt(B / 16), the base's warm-up in samples;
* ``linear``: Adam, lr = lr16 * B / 16, warm-up over 5% of the steps (at least the base's);
  at B = 16 it is the sqrt arm, which is not run twice;
* ``lbfgs``: L-BFGS (lr 1, one iteration per step, strong Wolfe line search), from
  ``lbfgs_min_batch`` up, for half the steps; its samples count every function evaluation
  (``samples_evaluated`` in the step records);
* ``adam_lbfgs``: the linear rule's Adam for half the samples, then L-BFGS as above for the
  other half (``optim.switch_to_lbfgs_epoch``), from ``lbfgs_min_batch`` up;
* ``lamb``: LAMB (layer-wise trust ratio over Adam's update), from ``lamb_min_batch`` up,
  lr = ``lamb_lr`` * sqrt(B / 16) with the linear rule's warm-up. LAMB's lr is a relative step
  per layer, not Adam's: the family's ``lamb_lr`` defaults to 10 x its Adam lr, because a
  layer's Adam step is about lr per weight and its weights are about 0.1 at initialisation.

``[longer]`` adds arms at ``factor`` times the sample budget (``arms``: names of plain arms;
the long arm is NAME_xFACTOR): whether a large batch reaches the small batch's error given more
samples. They do not enter the critical batch, which compares equal budgets.

``run`` works through the unfinished arms in order, each in resumable segments: a segment ends
at ``train.time_limit_minutes`` (exit 99) and the next ``run`` resumes it, so a study longer
than a session continues where it stopped. ``report`` reads each arm's ``metrics.jsonl``
(validation records: ``data.eval_samples`` draws of ``data.eval_seed``), evaluates the final
checkpoint of finished arms on ``test_draws`` draws of the test seed (cached in the run
directory as ``test_eval.json``; an earlier report at ``--out`` keeps the rows of finished arms
whose run directories are gone), and names per family the critical batch: the largest batch
whose steps to the target are still at most half those of the batch four times smaller.

``--out`` gets the table's figures (each arm's steps to target and its test error's mean,
median and worst: small enough to keep in git); ``--raw`` the same report with every test
draw's error and parameters (several MB: keep it out of git; each arm's run directory caches
its own as ``test_eval.json``, so ``report --raw`` writes it again while the runs are there).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import tomllib


from bench.common import emit_json

BASE_BATCH = 16


def load_plan(path: str) -> dict:
    with open(path, "rb") as f:
        plan = tomllib.load(f)
    for key in ("batches", "rules", "family", "runs_dir"):
        if key not in plan:
            raise SystemExit(f"{path}: the plan needs '{key}'")
    return plan


def arms(plan: dict) -> list[dict]:
    """Every (family, batch, rule) of the plan with its run directory and --set overrides."""
    out = []
    for fam in plan["family"]:
        for batch in plan["batches"]:
            for rule in plan["rules"]:
                if rule == "linear" and batch == BASE_BATCH:
                    continue                # the same arm as sqrt at the base batch
                if rule in ("lbfgs", "adam_lbfgs") and batch < plan.get("lbfgs_min_batch", 0):
                    continue                # a full-batch method: noisy small batches defeat it
                if rule == "lamb" and batch < plan.get("lamb_min_batch", 0):
                    continue
                out.append(make_arm(plan, fam, batch, rule, f"{fam}_b{batch}_{rule}", 1))
    longer = plan.get("longer", {})
    for base in longer.get("arms", []):
        plain = next((a for a in out if a["name"] == base), None)
        if plain is None:
            raise SystemExit(f"[longer] arms: {base!r} is not an arm of the plan")
        out.append(make_arm(plan, plain["family"], plain["batch"], plain["rule"],
                            f"{base}_x{longer['factor']}", longer["factor"]))
    return out


def make_arm(plan: dict, fam: str, batch: int, rule: str, name: str, budget: int) -> dict:
    spec = dict(plan["family"][fam], samples=plan["family"][fam]["samples"] * budget)
    run_dir = os.path.join(plan["runs_dir"], name)
    return {"name": name, "family": fam, "batch": batch, "rule": rule, "budget": budget,
            "base": spec["base"], "run_dir": run_dir,
            "sets": overrides(plan, spec, batch, rule, run_dir)}


def overrides(plan: dict, spec: dict, batch: int, rule: str, run_dir: str) -> list[str]:
    # L-BFGS evaluates the loss more than once per step (the line search): half the steps
    evals = 2 if rule == "lbfgs" else 1
    steps = max(1, spec["samples"] // (batch * evals))
    if rule == "adam_lbfgs":  # Adam for half the samples, L-BFGS at half the steps for the rest
        adam_steps = max(1, spec["samples"] // (2 * batch))
        steps = adam_steps + max(1, spec["samples"] // (4 * batch))
    pool = max(base_pool(spec["base"]), batch)
    every_samples = spec.get("eval_every_samples", plan["eval_every_samples"])
    every = max(1, every_samples // pool)                   # epochs between validations
    micro = plan["micro_batch"]
    sets = [f"data.global_batch={batch}", f"data.n_samples={pool}",
            f"train.max_steps={steps}", f"train.epochs={steps * batch // pool + 1}",
            f"train.eval_every_epochs={every}", "train.levels=[]",
            f"train.micro_batch={micro if batch > micro else 0}",
            f"train.log_every={max(1, min(64, steps // 32))}",
            f"run.dir={run_dir!r}".replace("'", '"')]
    warm_samples = spec["warmup_steps"] * BASE_BATCH
    # the linear, lamb and adam_lbfgs rules warm up over 5% of their first-order steps, at
    # least the base's samples
    long_warm = max(warm_samples // batch, (adam_steps if rule == "adam_lbfgs" else steps) // 20, 1)
    if rule == "sqrt":
        lr = spec["lr"] * math.sqrt(batch / BASE_BATCH)
        warm = max(1, warm_samples // batch)
        sets += ["optim.name=\"adam\"", f"optim.lr={lr:.6g}", f"optim.warmup_steps={warm}"]
    elif rule == "linear":
        lr = spec["lr"] * batch / BASE_BATCH
        sets += ["optim.name=\"adam\"", f"optim.lr={lr:.6g}", f"optim.warmup_steps={long_warm}"]
    elif rule == "lamb":
        lr = spec.get("lamb_lr", 10 * spec["lr"]) * math.sqrt(batch / BASE_BATCH)
        sets += ["optim.name=\"lamb\"", f"optim.lr={lr:.6g}", f"optim.warmup_steps={long_warm}"]
    elif rule == "adam_lbfgs":
        lr = spec["lr"] * batch / BASE_BATCH
        sets += ["optim.name=\"adam\"", f"optim.lr={lr:.6g}", f"optim.warmup_steps={long_warm}",
                 f"optim.switch_to_lbfgs_epoch={adam_steps * batch // pool}",
                 "optim.lbfgs_max_iter=1"]
    elif rule == "lbfgs":
        sets += ["optim.name=\"lbfgs\"", "optim.lr=1.0", "optim.warmup_steps=0",
                 "optim.lbfgs_max_iter=1",
                 "optim.schedule=\"constant\"", "optim.min_lr=0.0"]
    else:
        raise SystemExit(f"unknown rule {rule!r}: use sqrt, linear, lamb, lbfgs or adam_lbfgs")
    return sets


def base_pool(path: str) -> int:
    """The base config's sample pool (data.n_samples): every arm keeps it, or the batch if
    larger, so the batch is the one thing that changes."""
    with open(path, "rb") as f:
        return int(tomllib.load(f).get("data", {}).get("n_samples", 1024))


def state(arm: dict) -> str:
    """'done', 'failed', 'started' or 'new' from the run directory: done once a segment exited
    0 or the newest checkpoint is at the arm's last step (a training that ended while nobody
    waited); failed once a segment exited otherwise than 0 or 99 (study_failed holds why)."""
    if os.path.exists(os.path.join(arm["run_dir"], "study_done")):
        return "done"
    if os.path.exists(os.path.join(arm["run_dir"], "study_failed")):
        return "failed"
    steps = records(arm["run_dir"], "step")
    last = dict(s.split("=", 1) for s in arm["sets"])["train.max_steps"]
    if steps and steps[-1]["step"] == int(last) and records(arm["run_dir"], "eval"):
        return "done"
    if os.path.isdir(os.path.join(arm["run_dir"], "checkpoints")):
        return "started"
    return "new"


def train_segment(arm: dict, ranks: int, minutes: float) -> int:
    exe = os.path.join(os.path.dirname(sys.executable), "deepfusion")
    launch = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", str(ranks), exe]
    limit = f"train.time_limit_minutes={max(minutes, 1e-6):.6g}"
    if state(arm) == "started":
        cmd = launch + ["train", "--resume", arm["run_dir"], "--set", limit]
    else:
        cmd = launch + ["train", arm["base"], "--overwrite"]
        for s in arm["sets"] + [limit]:
            cmd += ["--set", s]
    os.makedirs(arm["run_dir"], exist_ok=True)
    with open(arm["run_dir"] + ".log", "a") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    if rc == 0:
        open(os.path.join(arm["run_dir"], "study_done"), "w").close()
    elif rc != 99:      # not a segment's end: the arm failed (diverged, refused); keep why
        with open(arm["run_dir"] + ".log") as log, \
                open(os.path.join(arm["run_dir"], "study_failed"), "w") as out:
            out.write(failure(log.read().splitlines(), rc))
    return rc


def failure(lines: list[str], rc: int) -> str:
    """The reason an arm's training failed: the last deepfusion or Python error line of its log."""
    why = [ln for ln in lines if ln.startswith(("deepfusion:", "error:")) or "Error:" in ln]
    return (why[-1] if why else f"exit {rc}").strip()


def run(plan: dict, ranks: int, minutes: float, only) -> int:
    end = time.monotonic() + 60 * minutes
    for arm in arms(plan):
        if (only and arm["name"] not in only) or state(arm) in ("done", "failed"):
            continue
        left = (end - time.monotonic()) / 60
        if left < 1:
            print("time budget spent; run again to continue")
            return 0
        print(f"{arm['name']}: {state(arm)}, segment of at most {left:.1f} min", flush=True)
        rc = train_segment(arm, ranks, max(left - 0.5, 0.5))
        print(f"{arm['name']}: exit {rc}", flush=True)
        if rc not in (0, 99):
            print(f"{arm['name']}: failed (exit {rc}); see {arm['run_dir']}.log")
    return 0


def records(run_dir: str, kind: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r.get("kind") == kind]


def to_target(arm: dict, target: float) -> dict:
    """Steps, samples and seconds at the first validation at or under ``target``."""
    evals = records(arm["run_dir"], "eval")
    steps = records(arm["run_dir"], "step")
    per_step = [r.get("samples_evaluated", arm["batch"]) for r in steps]
    evals_per_sample = (sum(per_step) / len(per_step) / arm["batch"]) if per_step else 1.0
    hit = next((e for e in evals if e["rel_l2_mean"] <= target), None)
    out = {"validations": len(evals),
           "last_validation": evals[-1]["rel_l2_mean"] if evals else None,
           "last_step": steps[-1]["step"] if steps else 0}
    if hit is not None:
        out.update(steps_to_target=hit["step"],
                   samples_to_target=int(hit["step"] * arm["batch"] * evals_per_sample),
                   seconds_to_target=hit["elapsed_s"])
    return out


def test_error(arm: dict, draws: int) -> dict | None:
    cache = os.path.join(arm["run_dir"], "test_eval.json")
    if os.path.exists(cache):
        with open(cache) as f:
            return json.load(f)
    if state(arm) != "done":
        return None
    exe = os.path.join(os.path.dirname(sys.executable), "deepfusion")
    out = subprocess.run([exe, "evaluate", arm["run_dir"], "--samples", str(draws),
                          "--out", cache], capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1:]}
    with open(cache) as f:
        return json.load(f)


def critical_batch(rows: list[dict]) -> int | None:
    """The largest batch whose steps to target are at most half those at a quarter of it."""
    steps = {r["batch"]: r.get("steps_to_target") for r in rows}
    best = None
    for b in sorted(steps):
        if b == min(steps):
            best = b if steps[b] else None
            continue
        prev = steps.get(b // 4)
        if steps[b] and prev and steps[b] <= prev / 2:
            best = b
    return best


def pct(v) -> str:
    return f"{100 * v:.2f}%" if v is not None else "-"


def table(doc: dict) -> str:
    """The report as a markdown table: one row per arm that ran, then the critical batches."""
    lines = ["| family | batch | rule | steps to target | samples to target | last validation "
             "| test: mean / median / worst (draws) |", "|---|---|---|---|---|---|---|"]
    for r in doc["arms"]:
        if r.get("state") == "new":
            continue
        t = r.get("test") or {}
        test = (f"{pct(t['rel_l2_mean'])} / {pct(t['rel_l2_median'])} / {pct(t['rel_l2_max'])} "
                f"({t['n']})" if "rel_l2_mean" in t else r.get("state", "-"))
        if r.get("state") == "failed":
            test = f"failed at step {r.get('last_step')}: {r.get('failure', '')}"
        rule = r["rule"] + (f", {r['budget']}x samples" if r.get("budget", 1) > 1 else "")
        lines.append(f"| {r['family']} | {r['batch']} | {rule} | "
                     f"{r.get('steps_to_target') or 'not reached'} | "
                     f"{r.get('samples_to_target') or '-'} | {pct(r.get('last_validation'))} | "
                     f"{test} |")
    crit = ", ".join(f"{k} {v or '-'}" for k, v in doc["critical_batch"].items())
    return "\n".join(lines) + f"\n\ncritical batch (family/rule): {crit}"


def earlier_rows(path: str | None) -> dict:
    """Rows of an earlier report (``--out``'s file), kept for arms whose run directories are
    gone (a study spans sessions; a session may not keep runs/)."""
    if not path or not os.path.exists(path):
        return {}
    with open(path) as f:
        return {r["name"]: r for r in json.load(f)["arms"] if r.get("state") == "done"}


PER_DRAW = ("rel_l2", "params", "_examples")   # the raw figures: only in --raw


def summary(doc: dict) -> dict:
    """The report without the per-draw figures of each arm's test evaluation."""
    arms_ = [{**r, "test": {k: v for k, v in r["test"].items() if k not in PER_DRAW}}
             if isinstance(r.get("test"), dict) else r for r in doc["arms"]]
    return {**doc, "arms": arms_}


def report(plan: dict, targets: dict, earlier: dict | None = None) -> dict:
    rows = []
    for arm in arms(plan):
        if not os.path.isdir(arm["run_dir"]) and arm["name"] in (earlier or {}):
            rows.append(earlier[arm["name"]])
            continue
        target = targets.get(arm["family"], plan["family"][arm["family"]]["target"])
        row = {k: arm[k] for k in ("name", "family", "batch", "rule", "budget")}
        row.update(state=state(arm), target=target, **to_target(arm, target))
        row["test"] = test_error(arm, plan["test_draws"])
        if row["state"] == "failed":
            with open(os.path.join(arm["run_dir"], "study_failed")) as f:
                row["failure"] = f.read().strip()
        rows.append(row)
    crit = {}
    for fam in plan["family"]:
        for rule in plan["rules"]:
            shared = "sqrt" if rule == "linear" else rule     # linear's base batch is sqrt's
            mine = [r for r in rows if r["family"] == fam and r.get("budget", 1) == 1 and (
                r["rule"] == rule or (r["rule"] == shared and r["batch"] == BASE_BATCH))]
            crit[f"{fam}/{rule}"] = critical_batch(mine)
    return {"arms": rows, "critical_batch": crit,
            "note": "steps/samples to the validation target; test: deepfusion evaluate "
                    f"--samples {plan['test_draws']} on the final checkpoint"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.tools.batch_study", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=("run", "report", "arms"))
    p.add_argument("plan")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--minutes", type=float, default=150.0, help="wall budget of this call")
    p.add_argument("--only", nargs="*", default=None, help="arm names to run")
    p.add_argument("--target", nargs="*", default=[], metavar="FAMILY=ERR")
    p.add_argument("--out", default=None, help="the report's figures (JSON)")
    p.add_argument("--raw", default=None, help="the report with every test draw's figures")
    args = p.parse_args(argv)
    plan = load_plan(args.plan)
    if args.action == "arms":
        for arm in arms(plan):
            print(arm["name"], state(arm), " ".join(arm["sets"]))
        return 0
    if args.action == "run":
        return run(plan, args.ranks, args.minutes, args.only)
    targets = {k: float(v) for k, v in (t.split("=", 1) for t in args.target)}
    doc = report(plan, targets, earlier_rows(args.out))
    print(table(doc))
    emit_json(summary(doc), args.out)
    if args.raw:
        emit_json(doc, args.raw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
