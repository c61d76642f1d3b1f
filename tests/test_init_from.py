"""model.init_from: a run starts from another run's generator weights (coarse-to-fine)."""
import glob

import pytest
import torch

from deepfusion.app.build import build_model, build_problem
from deepfusion.engine.checkpoint.store import load_checkpoint
from deepfusion.config import load_config
from tests.in_process import deepfusion_here
from tests.tiny_configs import TINY


@pytest.fixture(scope="module")
def coarse(tmp_path_factory):
    d = tmp_path_factory.mktemp("coarse")
    (d / "tiny.toml").write_text(TINY)
    p = deepfusion_here(["train", str(d / "tiny.toml"), "--set", f"run.dir={d / 'run'}",
                         "--set", "train.epochs=1"])
    assert p.returncode == 0, p.stderr
    return str(d / "tiny.toml"), sorted(glob.glob(str(d / "run/checkpoints/step_*.h5")))[-1]


def test_weights_are_taken_on_another_grid(coarse):
    config, ckpt = coarse
    cfg = load_config(config, ["problem.grid=[32, 32]", f"model.init_from={ckpt!r}".replace("'", '"')])
    model, _ = build_model(cfg, build_problem(cfg))
    saved = load_checkpoint(ckpt)["model_state"]
    assert set(saved) == set(model.state_dict())
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, saved[k].to(v.dtype), rtol=0, atol=0)
    cfg = load_config(config, ["problem.grid=[32, 32]"])
    fresh = build_model(cfg, build_problem(cfg))[0].state_dict()
    assert any(not torch.equal(fresh[k], v) for k, v in model.state_dict().items())


def test_other_architecture_refused_with_the_fix(coarse, tmp_path):
    config, ckpt = coarse
    p = deepfusion_here(["train", config, "--set", f"run.dir={tmp_path / 'b'}",
                         "--set", f'model.init_from="{ckpt}"',
                         "--set", "model.options={depth = 2, base_width = 8}"])
    assert p.returncode == 2, p.stderr
    assert "model.init_from" in p.stderr and "set [model] name and options to match" in p.stderr
    p = deepfusion_here(["train", config, "--set", f"run.dir={tmp_path / 'c'}",
                         "--set", f'model.init_from="{tmp_path / "missing.h5"}"'])
    assert p.returncode == 2 and "checkpoint not found" in p.stderr, p.stderr
