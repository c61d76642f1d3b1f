"""The measured probe of ``deepfusion check``: a few training steps of each level, at one
data-parallel unit's share of its global batch, on this host, in a child process.

The child is ``train`` cut short: the same builds (``build.build_checked``), the same
``Trainer``, on a config where every level of the plan is visited once, as listed, for
``warmup + steps`` steps at the batch one unit of the checked job takes (``global batch / (P /
ranks per sample)``). One unit is one rank, or under ``parallel.domain`` the group of ranks
that shares a sample, which the child then runs as that many local MPI ranks. Per level it
reports the median of the step times after the warm-up and the peak resident memory of a rank
during the level's steps (``/proc/self/clear_refs`` resets the peak at each level's start),
and what the input cache holds then against what it will hold once the whole pool has been
seen (it keeps every built input up to a cap). Nothing is checkpointed; the run directory is
a temporary one. What it measures is this host's speed with these threads: a cluster node's
differs, and communication between units is not in it.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace

from deepfusion.config import config_from_dict, config_to_dict, dump_toml, load_config
from deepfusion.engine.train.plan import plan
from deepfusion.engine.parallel.memory import proc_status_mib
from deepfusion.app.preflight import data_units

STEPS = 3    # measured steps per level (--probe-steps)
WARMUP = 1   # steps per level before those: first-touch allocations, kernel selection
CACHE_CAP = 2 * 2**30  # the input cache's default cap (engine.data.InputCache)


def probe_config(cfg, size: int, steps: int, run_dir: str, threads: int):
    """The config the child trains: every level once, as listed, ``WARMUP + steps`` steps at
    one data-parallel unit's batch of a ``size``-rank job; no evaluation, no plots."""
    units, n = data_units(cfg, size), WARMUP + steps
    raw = config_to_dict(cfg)
    d, t = raw["data"], raw["train"]
    base = d["global_batch"]
    d.update(global_batch=base // units, eval_samples=0)
    t["levels"] = [{**lv, "steps": n, "epochs": 0,
                    "global_batch": (lv.get("global_batch") or base) // units}
                   for lv in t.get("levels", [])]
    t.update(cycle="", max_steps=0 if t["levels"] else n, epochs=max(t["epochs"], n),
             eval_every_epochs=0, checkpoint_every=0, time_limit_minutes=0.0,
             on_nonfinite="stop", log_every=10**6)
    raw["parallel"]["threads_per_rank"] = threads
    raw["run"].update(dir=run_dir, plots=False, progress="log")
    return config_from_dict(raw)


def run_probe(cfg, size: int, threads: int, steps: int = STEPS, timeout: float = 900.0) -> dict:
    """Run the probe in a child process (``mpiexec -n D`` under a domain split of D ranks per
    sample); its report, or ValueError with the child's last lines if it failed."""
    work = tempfile.mkdtemp(prefix="deepfusion-probe-")
    try:
        pcfg = probe_config(cfg, size, steps, os.path.join(work, "run"), threads)
        path, out = os.path.join(work, "probe.toml"), os.path.join(work, "probe.json")
        with open(path, "w") as f:
            f.write(dump_toml(pcfg))
        argv = [sys.executable, "-m", "deepfusion.app.probe", path, out]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        ranks = cfg.parallel.blocks()
        if ranks > 1:
            argv = [mpiexec(), "-n", str(ranks), *argv]
        # one process: the serial communicator; a group: real MPI, whatever this process uses
        env["DEEPFUSION_NO_MPI"] = "0" if ranks > 1 else "1"
        try:
            res = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ValueError(f"the probe did not finish in {timeout:.0f} s (--probe-timeout); "
                             f"skip it with --no-probe") from None
        if res.returncode != 0 or not os.path.exists(out):
            tail = "\n".join((res.stderr or res.stdout).strip().splitlines()[-6:])
            raise ValueError(f"the probe failed (exit {res.returncode}):\n{tail}")
        with open(out) as f:
            report = json.load(f)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report.update(steps=steps, warmup=WARMUP, ranks=ranks)
    return report


def mpiexec() -> str:
    """The venv's mpiexec (the MPI mpi4py was built against), else the one on the PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else (shutil.which("mpiexec") or "mpiexec")


# ---------------------------------------------------------------------------------------------
# the child
# ---------------------------------------------------------------------------------------------

def reset_peak() -> bool:
    """Reset this process's peak resident memory (VmHWM); False where the kernel does not
    let it (the peaks are then peaks since the start)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def probe_trainer(base):
    """``base`` (the Trainer class) recording, per visit, the step times, the peak resident
    memory and what the input cache holds; checkpoints are not written."""
    class ProbeTrainer(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.records, self.resets = [], True

        def enter(self, visit, *, fresh=False):
            if self.visit is None or self.visit.index != visit.index or fresh:
                self.close_visit()
                self.resets = reset_peak() and self.resets
                self.records.append({"level": visit.level, "grid": list(visit.grid),
                                     "local_batch": visit.global_batch // self.model.data_size,
                                     "micro_batch": visit.micro_batch, "times": []})
            super().enter(visit, fresh=fresh)

        def close_visit(self):
            if self.records and "peak_mib" not in self.records[-1]:
                cache = self.inputs
                per = cache.used / len(cache.cache) if cache.cache else 0.0
                full = min(self.cfg.data.n_samples * per, cache.cap_bytes)
                self.records[-1].update(peak_mib=proc_status_mib("VmHWM") or 0.0,
                                        cache_mib=cache.used / 2**20,
                                        cache_full_mib=full / 2**20)

        def log_step(self, epoch, res):
            self.records[-1]["times"].append(res.times["step"])
            super().log_step(epoch, res)

        def save_checkpoint(self):
            pass
    return ProbeTrainer


def child(config: str, out: str) -> int:
    """Train the probe config (as ``train`` does, cut short) and write the report to ``out``."""
    from deepfusion.engine.parallel.comm import world
    from deepfusion.engine.parallel.layout import agreed_precision, setup_threads
    from deepfusion.engine.parallel.memory import reuse_freed_memory
    from deepfusion.app.train import on_every_rank

    cfg = load_config(config)
    comm = world()
    layout, _ = setup_threads(comm, cfg.parallel.threads_per_rank)  # before torch
    reuse_freed_memory(cfg.parallel.reuses_memory())
    precision = agreed_precision(cfg.train.precision, comm)
    from deepfusion.engine.parallel.parallelize import parallelize
    from deepfusion.engine.train.trainer import Trainer
    from deepfusion.app.build import build_checked, first_grid, model_grower, prepare_run_dir, torch_dtype

    problem, model, specs, problems = build_checked(cfg, on_every_rank(comm))
    prepare_run_dir(cfg, False, False, comm.rank)
    pmodel = parallelize(model, comm, cfg.parallel, compile=cfg.train.compile,
                         grid=first_grid(cfg))
    run_cfg = replace(cfg, train=replace(cfg.train, precision=precision))
    trainer = probe_trainer(Trainer)(run_cfg, comm, problem, pmodel, specs=specs,
                                     dtype=torch_dtype(cfg), problems=problems,
                                     grow=model_grower(cfg, problem))
    trainer.fit()
    trainer.close_visit()
    peaks = comm.gather_obj([r["peak_mib"] for r in trainer.records])
    if comm.rank == 0:
        for i, r in enumerate(trainer.records):
            r["peak_mib"] = max(p[i] for p in peaks)  # the largest rank of a domain group
            r["median_step_s"] = statistics.median(r["times"][WARMUP:] or r["times"])
        report = {"host": layout.host, "threads": layout.threads, "precision": precision,
                  "peak_reset": trainer.resets, "levels": trainer.records,
                  "planned_levels": len(plan(cfg))}
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(child(*sys.argv[1:3]))
