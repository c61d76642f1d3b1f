"""OpenMP reads OMP_NUM_THREADS once, when torch loads it: every distributed command must set
the thread layout before torch is imported (the command modules import it lazily)."""
import json
import os
import subprocess
import sys

import pytest

from tests.mpi_util import ROOT
from tests.tiny_configs import TINY

SPY = """
import sys
import deepfusion.engine.parallel.layout as layout
real = layout.setup_threads
def spy(comm, requested=0):
    print("torch before threads:", "torch" in sys.modules, flush=True)
    return real(comm, requested)
layout.setup_threads = spy
import deepfusion.app.train, deepfusion.app.infer
deepfusion.app.train.setup_threads = spy
from deepfusion.cli import main
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



BLAS = """
import json
import numpy  # loaded before the layout, as the communicator's module loads it
from threadpoolctl import threadpool_info
from deepfusion.engine.parallel.comm import world
from deepfusion.engine.parallel.layout import setup_threads
def blas(): return sorted({i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"})
before = blas()
setup_threads(world(), 1)
import scipy.sparse.linalg  # loaded after the layout: reads OMP_NUM_THREADS
print(json.dumps([before, blas()]))
"""


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: a BLAS runs one thread anyway")
def test_a_blas_loaded_before_the_layout_runs_the_ranks_threads():
    """numpy's OpenBLAS reads the core count when it loads, before the layout sets the threads;
    after ``setup_threads`` every BLAS must run the rank's threads."""
    env = {"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"}  # no OMP_NUM_THREADS from the caller
    p = subprocess.run([sys.executable, "-c", BLAS], capture_output=True, text=True, cwd=ROOT,
                       timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    before, after = json.loads(p.stdout.strip().splitlines()[-1])
    assert max(before) > 1, f"the check needs a BLAS that started with several threads: {before}"
    assert after == [1], f"BLAS threads after setup_threads(1): {after}"
