"""OpenMP reads OMP_NUM_THREADS once, when torch loads it: every distributed command must set
the thread layout before torch is imported (the command modules import it lazily)."""
import subprocess
import sys

from tests.mpi_util import ROOT
from tests.tiny_configs import TINY

SPY = """
import sys
import deepfusion.engine.layout as layout
real = layout.setup_threads
def spy(comm, requested=0):
    print("torch before threads:", "torch" in sys.modules, flush=True)
    return real(comm, requested)
layout.setup_threads = spy
import deepfusion.app.train, deepfusion.app.inference_cli
deepfusion.app.train.setup_threads = spy
from deepfusion.app.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _run(*args):
    p = subprocess.run([sys.executable, "-c", SPY, *args], capture_output=True, text=True,
                       cwd=ROOT, timeout=240, env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_train_and_evaluate_set_threads_before_importing_torch(tmp_path):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    run = str(tmp_path / "r")
    out = _run("train", str(cfg), "--set", f"run.dir={run}", "--set", "train.max_steps=2")
    assert "torch before threads: False" in out
    out = _run("evaluate", run, "--samples", "2")
    assert "torch before threads: False" in out
