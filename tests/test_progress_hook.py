"""The trainer tells the problem how far training is (Problem.set_progress) before every step."""
from __future__ import annotations

import os

import pytest

from deepfusion.app.build import build_model, build_problem, torch_dtype
from deepfusion.engine.parallel.parallelize import parallelize
from deepfusion.engine.parallel.comm import SerialComm
from deepfusion.config import load_config
from deepfusion.engine.train.trainer import Trainer

TOML = """
[problem]
name = "burgers"
grid = [16, 16]
options = { hard_bc = true, scheme = "lax-oleinik", smoothing = 0.2, smoothing_until = 0.5 }
[model]
name = "unet"
options = {depth = 2, base_width = 4}
[data]
n_samples = 8
global_batch = 4
eval_samples = 0
[train]
epochs = 3
log_every = 100
[parallel]
threads_per_rank = 1
"""


def tiny_trainer(tmp_path, prepare=lambda problem: None) -> Trainer:
    """A one-process trainer of TOML, its run in tmp_path/run; ``prepare(problem)`` first."""
    path = tmp_path / "c.toml"
    path.write_text(TOML)
    cfg = load_config(str(path), [f"run.dir={tmp_path / 'run'}"])
    os.makedirs(tmp_path / "run" / "checkpoints")
    task = build_problem(cfg)
    prepare(task)
    model, specs = build_model(cfg, task)
    pm = parallelize(model, SerialComm(), cfg.parallel)
    return Trainer(cfg, SerialComm(), task, pm, specs=specs, dtype=torch_dtype(cfg))


def test_trainer_sets_progress_before_every_step(tmp_path):
    seen = []

    def watch(task):
        original = task.set_progress

        def record(fraction):
            original(fraction)
            seen.append((fraction, task.current_smoothing()))

        task.set_progress = record

    tiny_trainer(tmp_path, watch).fit()
    assert [f for f, _ in seen] == pytest.approx([s / 6 for s in range(6)])  # 3 epochs x 2 steps
    # the smoothing width the loss used at each step: 0.2 falling to 0 at half of training
    assert [s for _, s in seen] == pytest.approx([0.2, 0.2 * 2 / 3, 0.2 / 3, 0, 0, 0])
