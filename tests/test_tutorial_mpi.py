"""The tutorial's PDE (examples/advection_diffusion.py, docs/your-own-pde.md), run tiny from the
repository as a user runs it: found through the PYTHONPATH, trained under ``mpiexec -n 2``
with data parallelism and with each sample split over the two ranks (``parallel.domain =
[1, 2]``: the same losses, float64), evaluated against its own reference solver and answered by
``infer``, each in a new process. Also: the example Heat family now splits too."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from diffnet.problems import get_problem
from diffnet.problems.check.problem import check_problem
from tests.mpi_util import HANG_GUARD, ROOT, run_mpi

EXAMPLES = os.path.join(ROOT, "examples")
ENV = {"PYTHONPATH": os.pathsep.join([ROOT, EXAMPLES]), "DEEPFUSION_NO_MPI": "0"}
CONFIG = os.path.join(EXAMPLES, "advection_diffusion.toml")
NAME = "advection_diffusion:AdvectionDiffusion"
TINY = ["train.max_steps=3", "train.epochs=2", "data.n_samples=16", "data.eval_samples=2",
        'train.dtype="float64"', "train.log_every=1"]


def deepfusion(n: int, args: list[str]) -> subprocess.CompletedProcess:
    """``deepfusion ARGS`` with the examples on the PYTHONPATH: on n ranks, or (n=0) as one
    plain process."""
    if n:
        return run_mpi(n, ["-m", "deepfusion"] + args, env=ENV)
    return subprocess.run([sys.executable, "-m", "deepfusion"] + args, capture_output=True,
                          text=True, timeout=HANG_GUARD, cwd=ROOT, env={**os.environ, **ENV})


def step_losses(run_dir) -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f) if r["kind"] == "step"]


@pytest.mark.mpi
@pytest.mark.full
def test_the_tutorial_trains_split_and_undivided_evaluates_and_infers(tmp_path):
    runs = {}
    for label, extra in (("data", []), ("domain", ["parallel.domain=[1, 2]"])):
        runs[label] = str(tmp_path / label)
        sets = [a for s in TINY + extra + [f"run.dir={runs[label]}"] for a in ("--set", s)]
        p = deepfusion(2, ["train", CONFIG] + sets)
        assert p.returncode == 0, p.stderr
    assert "domain split [1, 2]" in p.stdout
    split, whole = step_losses(runs["domain"]), step_losses(runs["data"])
    assert len(split) == 3 and split == pytest.approx(whole, rel=1e-9)

    p = deepfusion(0, ["evaluate", runs["domain"], "--samples", "2"])
    assert p.returncode == 0 and "test relative L2 over 2 draws" in p.stdout, p.stderr
    out = str(tmp_path / "answers.h5")
    p = deepfusion(0, ["infer", runs["domain"], "--samples", "2", "--seed", "7", "--out", out])
    assert p.returncode == 0 and "2 samples of advection_diffusion 16x16" in p.stdout, p.stderr
    assert os.path.getsize(out) > 0


def test_the_tutorial_and_heat_pass_the_checker_with_their_splits(monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLES)
    for name in (NAME, "heat:Heat"):
        report = check_problem(name)
        assert report.ok, report.text()
        assert "OK    split [2, 2] against undivided" in report.text()


def test_the_tutorial_reference_zeroes_the_loss(monkeypatch):
    """The reference solver solves the loss's own discretisation: its residual is rounding."""
    monkeypatch.syspath_prepend(EXAMPLES)
    import torch

    p = get_problem(NAME, grid=(12, 16))
    params = p.sample_params(3, range(2))
    x = p.build_input(params, torch.float64)
    u = torch.stack([torch.as_tensor(p.reference_solution(q)) for q in params])[:, None]
    terms = p.loss_terms(u, x)
    assert float(terms["pde"].max()) < 1e-20 and float(terms["bc"].max()) == 0
    assert float(u.abs().max()) > 0.1
