"""What a run leaves behind: metrics.jsonl, the log line, the progress bar, the loss curve.

Only rank 0 writes shared files. One log line per N steps with fixed fields
(``step grid loss <the problem's loss terms> grad_norm lr s/step samples/s``) so batch-job logs can be grepped and
diffed; a tqdm bar instead when rank 0 is attached to a terminal.
"""
from __future__ import annotations

import json
import math
import os
import sys

from .atomic import atomic_path

class RunLog:
    """Rank-0 writer of metrics.jsonl and the console; a no-op elsewhere."""

    def __init__(self, run_dir: str, *, rank: int, log_every: int, progress: str,
                 total_steps: int, term_names: tuple[str, ...]):
        self.run_dir, self.rank, self.log_every = run_dir, rank, max(1, log_every)
        self.term_names = tuple(term_names)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        use_bar = progress == "bar" or (progress == "auto" and sys.stdout.isatty())
        self.bar = None
        if rank == 0 and use_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True)
        self._header_done = False

    def truncate_after(self, step: int):
        """On resume: drop records past the checkpoint, so the file reads as one run."""
        if self.rank != 0 or not os.path.exists(self.path):
            return
        keep = []
        with open(self.path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    break  # a line cut by the kill that interrupted the run
                if rec.get("step", 0) > step:  # step, epoch and eval records all carry the step
                    break
                keep.append(line if line.endswith("\n") else line + "\n")
        with atomic_path(self.path) as tmp, open(tmp, "w") as f:
            f.writelines(keep)

    def record(self, rec: dict):
        if self.rank != 0:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def step(self, rec: dict):
        self.record(rec)
        if self.rank != 0:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{rec['loss']:.3e}", gn=f"{rec['grad_norm']:.2e}")
            return
        if rec["step"] % self.log_every == 0 or rec["step"] == 1:
            if not self._header_done:
                names = " ".join(f"{n:>10}" for n in self.term_names)
                print(f"{'step':>7} {'grid':>9} {'loss':>11} {names} {'grad_norm':>10} {'lr':>9} "
                      f"{'s/step':>8} {'samples/s':>9}", flush=True)
                self._header_done = True
            terms = " ".join(f"{rec[n]:10.3e}" for n in self.term_names)
            grid = "x".join(str(g) for g in rec["grid"])
            print(f"{rec['step']:7d} {grid:>9} {rec['loss']:11.4e} {terms} {rec['grad_norm']:10.3e} "
                  f"{rec['lr']:9.2e} {rec['time_step']:8.3f} {rec['samples_per_s']:9.1f}", flush=True)

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


def plot_loss_curve(metrics_path: str, out_png: str):
    """Loss and its terms against step, log scale, and below it the validation error of the
    evaluations during the run; dashed lines mark where the grid changes (rank 0, end of run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, series, evals, changes = [], {}, [], []
    with open(metrics_path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("kind") == "eval" and "rel_l2_mean" in rec:  # (no reference: no error)
                evals.append((rec["step"], rec["rel_l2_mean"]))
            if rec.get("kind") != "step":
                continue
            grid = tuple(rec.get("grid", ()))
            if not changes or changes[-1][1] != grid:
                changes.append((rec["step"] - 1, grid))
            steps.append(rec["step"])
            for k in ("loss",) + tuple(k for k in rec.get("terms", {})):
                v = rec["loss"] if k == "loss" else rec["terms"][k]
                series.setdefault(k, []).append(v if v > 0 and math.isfinite(v) else float("nan"))
    rows = 2 if evals else 1
    fig, axes = plt.subplots(rows, 1, figsize=(6, 4 * rows), sharex=True, squeeze=False)
    ax = axes[0, 0]
    for k, v in series.items():
        ax.semilogy(steps[:len(v)], v, label=k)
    ax.set_ylabel("loss")
    ax.legend()
    if evals:
        axes[1, 0].semilogy(*zip(*evals), "o-", label="validation rel L2 (mean)")
        axes[1, 0].set_ylabel("relative L2")
        axes[1, 0].legend()
    for a in axes[:, 0]:
        a.grid(alpha=0.3)
        if len(changes) > 1:  # a multigrid run: mark every level change with its grid
            for step, grid in changes:
                a.axvline(step, color="k", ls="--", lw=0.7)
                a.text(step, 1.0, " " + "x".join(map(str, grid)), transform=a.get_xaxis_transform(),
                       fontsize=7, va="top")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
