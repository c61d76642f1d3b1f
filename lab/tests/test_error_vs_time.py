"""lab.tools.error_vs_time on the grown run of tests/test_prolong.py: held-out error against wall time."""
import json
import os

import pytest

from tests.test_prolong import full, mgp  # noqa: F401  (module fixtures)


@pytest.mark.mpi
def test_error_vs_time_bench_evaluates_the_final_grid_checkpoints(full, tmp_path):
    """lab.tools.error_vs_time on the grown run against a copy of itself: the same errors, a
    speed-up of exactly 1 (the copy reaches the run's error in the run's time)."""
    import shutil

    from lab.tools import error_vs_time

    base = str(tmp_path / "copy")
    shutil.copytree(full[0], base)
    out = tmp_path / "evt.json"
    assert error_vs_time.main([full[0], "--baseline", base, "--draws", "2", "--goal", "1",
                               "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    ours, theirs = res["runs"][full[0]], res["runs"][base]
    assert [p["step"] for p in ours] == [11] and ours == theirs
    s = res["speedup"][full[0]]
    assert (s["speedup"], s["bound"], s["met"]) == (1.0, "=", True)


def test_error_vs_time_stride_keeps_every_nth_checkpoint_and_the_last(tmp_path):
    from lab.tools import error_vs_time

    (tmp_path / "checkpoints").mkdir()
    for step in range(1, 8):
        (tmp_path / "checkpoints" / f"step_{step:08d}.h5").write_bytes(b"")
    names = lambda stride: [os.path.basename(p)[5:13]
                            for p in error_vs_time.checkpoints(str(tmp_path), stride)]
    assert names(1) == [f"{s:08d}" for s in range(1, 8)]
    assert names(3) == ["00000001", "00000004", "00000007"]
    assert names(4) == ["00000001", "00000005", "00000007"]
