"""The sweep's runs and commands: the tiny run it flips bits in (:func:`make_run`), and the
real ``deepfusion infer RUN_DIR`` and ``deepfusion train --resume RUN_DIR`` on a copy of that run
with one flipped bit (:func:`cli_case`): both must fall back to the previous checkpoint, saying
why."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

from tests.faults.files import Regions, flip_bit
from tests.mpi_util import ROOT, mpiexec
from tests.tiny_configs import TINY

STEP, PREVIOUS = "step_00000010.h5", "step_00000005.h5"


def env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
            "DEEPFUSION_NO_MPI": "1", **extra}


def train_args(run: str) -> list[str]:
    """The arguments of ``deepfusion`` that train the tiny one-process run with checkpoints at
    steps 5 and 10 into ``run`` (its config written beside it)."""
    os.makedirs(os.path.dirname(os.path.abspath(run)), exist_ok=True)
    cfg = os.path.abspath(run) + ".toml"
    with open(cfg, "w") as fh:
        fh.write(TINY)
    sets = [f"run.dir={run}", "train.checkpoint_every=5", "train.keep_checkpoints=3",
            "train.max_steps=10", "data.eval_samples=0"]
    return ["train", cfg] + [a for s in sets for a in ("--set", s)]


def make_run(run: str, timeout: float = 900) -> None:
    """Train the tiny run (:func:`train_args`) in a new process."""
    p = subprocess.run([sys.executable, "-m", "deepfusion"] + train_args(run),
                       capture_output=True, text=True, timeout=timeout, env=env(), cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"training the tiny run failed:\n{p.stderr}")


def _command(ranks: int, args: list[str], timeout: float):
    head = [mpiexec(), "-n", str(ranks)] if ranks > 1 else []
    e = env(DEEPFUSION_NO_MPI="0" if ranks > 1 else "1")
    try:
        return subprocess.run(head + [sys.executable, "-m", "deepfusion"] + args,
                              capture_output=True, text=True, timeout=timeout, env=e, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return None


def cli_case(run: str, bit: int, workdir: str, ranks: int, timeout: float) -> dict:
    """Flip ``bit`` of a copy of the run's newest checkpoint; infer and resume must fall back."""
    copy = os.path.join(workdir, f"cli_{bit}")
    shutil.copytree(run, copy)
    flip_bit(os.path.join(copy, "checkpoints", STEP), bit)
    out = {"bit": bit}
    p = _command(ranks, ["infer", copy, "--samples", "2", "--out",
                         os.path.join(workdir, f"pred_{bit}.h5")], timeout)
    out["infer"] = _verdict(p, lambda: f"using {PREVIOUS}" in p.stderr
                            and f"skipped the newer {STEP}" in p.stderr)
    p = _command(ranks, ["train", "--resume", copy, "--set", "train.max_steps=12"], timeout)
    out["resume"] = _verdict(p, lambda: sum(f"skipped checkpoint {STEP}" in line
                                            for line in p.stderr.splitlines()) == 1
                             and f"resumed from {os.path.join(copy, 'checkpoints', PREVIOUS)}"
                             in p.stdout)
    shutil.rmtree(copy, ignore_errors=True)
    return out


def _verdict(p, fell_back) -> str:
    if p is None:
        return "hang"
    if p.returncode != 0:
        return f"crash (exit {p.returncode}): {(p.stderr.strip().splitlines() or [''])[-1]}"
    return "fell back, saying why" if fell_back() else "silent"


def cli_sample(regions: Regions, bits: list[int], n: int) -> list[int]:
    """Up to n of ``bits``, taken in turn from the metadata, data and seal regions."""
    by = {r: [b for b in bits if regions.of(b // 8) == r] for r in ("metadata", "data", "seal")}
    picked = []
    while len(picked) < n and any(by.values()):
        for r in by:
            if by[r] and len(picked) < n:
                picked.append(by[r].pop(0))
    return picked
