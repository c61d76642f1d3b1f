"""The contained check of an unsealed checkpoint starts without torch, so its hang guard is
seconds, not the minutes a child importing torch would need."""
import json
import subprocess
import sys

import h5py
import numpy as np

from deepfusion.engine.checkpoint import contained
from tests.mpi_util import ROOT


def test_the_child_reads_every_object_without_importing_torch(tmp_path):
    path = tmp_path / "old.h5"
    with h5py.File(path, "w") as f:
        f.attrs["version"] = 2
        f.create_group("model_state").create_dataset("w", data=np.arange(6.0))
    probe = ("import sys; from deepfusion.engine.checkpoint import contained; "
             "contained.main([sys.argv[1]]); print('torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    answer, torch_loaded = p.stdout.strip().splitlines()
    assert "sha256" in json.loads(answer) and torch_loaded == "False", p.stderr
    assert contained.SECONDS <= 30     # a guard of seconds


def test_the_child_names_a_file_hdf5_cannot_read(tmp_path):
    path = tmp_path / "bad.h5"
    path.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(200))
    p = subprocess.run([sys.executable, "-m", "deepfusion.engine.checkpoint.contained", str(path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    answer = json.loads(p.stdout)
    assert p.returncode == 0 and answer["error"] and answer["opened"] is False
