"""train.compile: the torch.compile'd generator trains the same trajectory (to float32 rounding)
and leaves its kernel cache in the run directory."""
import json
import os
import shutil

import pytest

from tests.in_process import deepfusion_here
from tests.mpi_util import deepfusion

pytestmark = [pytest.mark.slow, pytest.mark.full]

ARGS = ["--set", "problem.name=\"burgers\"", "--set", "problem.grid=[16,16]", "--set", "model.options={depth=1, base_width=4}",
        "--set", "data.n_samples=8", "--set", "data.global_batch=4", "--set", "train.max_steps=3",
        "--set", "data.eval_samples=0", "--set", "parallel.threads_per_rank=1",
        "--set", "train.log_every=1", "--set", "run.plots=false"]


def losses(d):
    with open(os.path.join(d, "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f) if r["kind"] == "step"]


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="torch.compile needs a C++ compiler")
def test_compiled_training_matches_eager(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # other tests may export one
    eager, comp = str(tmp_path / "eager"), str(tmp_path / "comp")
    p = deepfusion_here(["train"] + ARGS + ["--set", f"run.dir={eager}"])  # the reference
    assert p.returncode == 0, p.stderr
    p = deepfusion(0, ["train"] + ARGS + ["--set", f"run.dir={comp}", "--set", "train.compile=true"])
    assert p.returncode == 0, p.stderr
    assert losses(comp) == pytest.approx(losses(eager), rel=1e-3)
    assert os.listdir(os.path.join(comp, "compile_cache"))
