"""What a run leaves behind: metrics.jsonl, the log line, the progress bar, the loss curve.

Only rank 0 writes shared files. One log line per N steps with fixed fields (``step/total grid
loss <the problem's loss terms> grad_norm lr s/step samples/s elapsed eta``) so batch-job logs
can be grepped and diffed; a tqdm bar instead when rank 0 is attached to a terminal. The ETA
comes from :class:`~deepfusion.engine.run.eta.StepClock`. :func:`read_metrics` reads the file
back as it is, while a job may still be writing it (``deepfusion status`` and ``plot``).
"""
from __future__ import annotations

import json
import math
import os
import sys

from deepfusion.engine.checkpoint.atomic import atomic_path
from deepfusion.engine.run.eta import StepClock, eta_text, format_duration
from deepfusion.engine.run.identity import read_run_id


REJECTED = "metrics.rejected.jsonl"   # lines of metrics.jsonl that are no record, set aside


def parse_record(line: str) -> dict | None:
    """The record on one line of metrics.jsonl, None if the line is not one."""
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and "kind" in rec else None


class RunLog:
    """Rank-0 writer of metrics.jsonl and the console; a no-op elsewhere."""

    def __init__(self, run_dir: str, *, rank: int, log_every: int, progress: str,
                 visits: list, term_names: tuple[str, ...], known_total: bool = True):
        self.run_dir, self.rank, self.log_every = run_dir, rank, max(1, log_every)
        self.term_names = tuple(term_names)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.run_id = read_run_id(run_dir) if rank == 0 else None   # in every record
        use_bar = progress == "bar" or (progress == "auto" and sys.stdout.isatty())
        self.bar = None
        if rank == 0 and use_bar:
            from tqdm import tqdm

            self.bar = tqdm(unit="step", dynamic_ncols=True)
        self.clock = None
        self.set_plan(visits, known_total)
        self._header_done = False

    def set_plan(self, visits: list, known_total: bool = True):
        """The plan the log counts against (``known_total`` false: its length is not decided
        yet, a time budget's first steps: the total and the ETA show as "?")."""
        total_steps = visits[-1].end
        if self.clock is None:
            self.clock = StepClock(visits)
        self.clock.visits, self.known_total = list(visits), known_total  # (keeps its times)
        self.total_steps, self.step_width = total_steps, len(str(total_steps)) if known_total else 1
        if self.bar is not None:
            self.bar.total = total_steps if known_total else None
            self.bar.refresh()

    def truncate_after(self, step: int):
        """On resume: drop records past the checkpoint, so the file reads as one run. A line
        that is no record (damaged, or cut by the kill that interrupted the run) is moved to
        ``metrics.rejected.jsonl`` with its line number, and said: never a reason to drop the
        good records after it."""
        if self.rank != 0 or not os.path.exists(self.path):
            return
        keep, bad = [], []
        with open(self.path, errors="replace") as f:
            for n, line in enumerate(f, 1):
                rec = parse_record(line)
                if rec is None:
                    if line.strip():
                        bad.append(json.dumps({"line": n, "text": line.rstrip("\n")}) + "\n")
                elif rec.get("step", 0) <= step:  # step, epoch and eval records carry the step
                    keep.append(line if line.endswith("\n") else line + "\n")
        if bad:
            with open(os.path.join(self.run_dir, REJECTED), "a") as f:
                f.writelines(bad)
            self.warn(f"{self.path}: {len(bad)} line(s) that are no record (damaged, or cut by "
                      f"a kill) moved to {REJECTED}; the other records are kept")
        with atomic_path(self.path) as tmp, open(tmp, "w") as f:
            f.writelines(keep)

    def record(self, rec: dict):
        if self.rank != 0:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({**rec, "run": self.run_id}) + "\n")

    def step(self, visit, epoch: int, step: int, res, *, elapsed: float, segment: float):
        """Step ``step`` of ``visit`` was taken with result ``res``: its metrics record, and the
        log line or the bar (rank 0). ``elapsed``: the trajectory's wall time over all resumed
        segments; ``segment``: this process's."""
        if self.rank != 0:
            return
        t = res.times
        self.clock.tick(visit, t["step"])
        eta, scaled = self.clock.eta(step) if self.known_total else (None, False)
        rec = {"kind": "step", "step": step, "epoch": epoch, "level": visit.level,
               "grid": list(visit.grid), "loss": res.loss,
               **res.terms, "terms": res.terms, "grad_norm": res.grad_norm, "lr": res.lr,
               **{f"time_{k}": v for k, v in t.items()},
               "samples_per_s": visit.global_batch / t["step"] if t["step"] > 0 else 0.0,
               "elapsed_s": elapsed, "segment_s": segment, "eta_s": eta, "eta_scaled": scaled,
               **res.metrics, **res.comm}
        self.record(rec)
        self.show(rec)

    def epoch(self, epoch: int, step: int, seconds: float, samples: int):
        """Epoch ``epoch``, run whole, ended at ``step``: its metrics record (its time and
        throughput)."""
        self.record({"kind": "epoch", "epoch": epoch, "step": step, "time_epoch": seconds,
                     "samples_per_s": samples / seconds})

    def show(self, rec: dict):
        """The bar's update, or every ``log_every`` steps (and the first) the log line."""
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{rec['loss']:.3e}", gn=f"{rec['grad_norm']:.2e}")
            return
        if rec["step"] % self.log_every == 0 or rec["step"] == 1:
            w = self.step_width
            if not self._header_done:
                names = " ".join(f"{n:>10}" for n in self.term_names)
                print(f"{'step':>{max(7, 2 * w + 1)}} {'grid':>9} {'loss':>11} {names} "
                      f"{'grad_norm':>10} {'lr':>9} {'s/step':>8} {'samples/s':>9} "
                      f"{'elapsed':>9} {'eta':>10}", flush=True)
                self._header_done = True
            terms = " ".join(f"{rec[n]:10.3e}" for n in self.term_names)
            grid = "x".join(str(g) for g in rec["grid"])
            where = f"{rec['step']:>{w}d}/{self.total_steps if self.known_total else '?'}"
            eta = eta_text(rec["eta_s"], rec["eta_scaled"])
            print(f"{where:>{max(7, 2 * w + 1)}} {grid:>9} {rec['loss']:11.4e} {terms} "
                  f"{rec['grad_norm']:10.3e} {rec['lr']:9.2e} {rec['time_step']:8.3f} "
                  f"{rec['samples_per_s']:9.1f} {format_duration(rec['elapsed_s']):>9} "
                  f"{eta:>10}", flush=True)

    def info(self, msg: str):
        if self.rank == 0:
            (self.bar.write if self.bar is not None else print)(msg)
            sys.stdout.flush()

    def warn(self, msg: str):
        """A warning about a decision all ranks took together: printed once, by rank 0."""
        if self.rank == 0:
            print(f"warning: {msg}", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def read_metrics(path: str) -> list[dict]:
    """The records of a metrics.jsonl as it is now: a line being written (a job still running,
    or killed mid-write) or otherwise not a JSON object is skipped."""
    with open(path, errors="replace") as f:
        return [rec for rec in map(parse_record, f) if rec is not None]


def loss_curves(recs: list[dict]) -> tuple[dict, list, list]:
    """From metrics records: {loss or term: (steps, values)}, the validation points (step,
    mean, what it is) and the level changes (the step before, grid)."""
    series, evals, changes = {}, [], []
    for rec in recs:
        if rec["kind"] == "eval":
            for key, what in (("rel_l2_mean", "validation rel L2 (mean)"),
                              ("loss_mean", "validation loss (mean; no reference solver)")):
                if key in rec:
                    evals.append((rec["step"], rec[key], what))
        if rec["kind"] != "step":
            continue
        grid = tuple(rec.get("grid", ()))
        if not changes or changes[-1][1] != grid:
            changes.append((rec["step"] - 1, grid))
        for k, v in (("loss", rec["loss"]), *rec.get("terms", {}).items()):
            xs, ys = series.setdefault(k, ([], []))
            xs.append(rec["step"])
            ys.append(v if math.isfinite(v) else float("nan"))
    return series, evals, changes


def draw(ax, curves: dict, style: str = "-"):
    """Each curve on ``ax``: log scale if every value is positive, else linear (a loss that
    goes negative, as a variational one does); a term that is zero throughout is left out."""
    shown = {k: xy for k, xy in curves.items() if any(y != 0 for y in xy[1])}
    positive = all(y > 0 for _, ys in shown.values() for y in ys if math.isfinite(y))
    for k, (xs, ys) in shown.items():
        ax.plot(xs, ys, style, label=k)
    if positive and shown:
        ax.set_yscale("log")
    if shown:
        ax.legend()


def plot_loss_curve(metrics_path: str, out_png: str, title: str = ""):
    """Loss and its terms against step, and below it the validation error (or loss) of the
    evaluations during the run; dashed lines mark where the grid changes. Written at the end of
    a run (rank 0) and by ``deepfusion plot`` at any time; published atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series, evals, changes = loss_curves(read_metrics(metrics_path))
    rows = 2 if evals else 1
    fig, axes = plt.subplots(rows, 1, figsize=(6, 4 * rows), sharex=True, squeeze=False)
    draw(axes[0, 0], series)
    axes[0, 0].set_ylabel("loss")
    if title:
        axes[0, 0].set_title(title, fontsize=9)
    if evals:
        by = {}
        for step, v, what in evals:
            xs, ys = by.setdefault(what, ([], []))
            xs.append(step)
            ys.append(v)
        draw(axes[1, 0], by, "o-")
        axes[1, 0].set_ylabel("relative L2" if any("rel L2" in k for k in by) else "loss")
    for a in axes[:, 0]:
        a.grid(alpha=0.3)
        if len(changes) > 1:  # a multigrid run: mark every level change with its grid
            for step, grid in changes:
                a.axvline(step, color="k", ls="--", lw=0.7)
                a.text(step, 1.0, " " + "x".join(map(str, grid)), transform=a.get_xaxis_transform(),
                       fontsize=7, va="top")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fmt = os.path.splitext(out_png)[1].lstrip(".").lower() or "png"
    with atomic_path(out_png) as tmp:  # a viewer never sees half a figure
        fig.savefig(tmp, dpi=100, format=fmt)
    plt.close(fig)
