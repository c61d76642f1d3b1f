"""lab.tools.winograd_ab at a tiny size: both steps timed over the same rounds from the same
weights, their first losses equal to float32 rounding."""
import json
import shutil

import pytest

from lab.tools import winograd_ab


@pytest.mark.skipif(shutil.which("gcc") is None, reason="the fused kernels are built with GCC")
def test_both_steps_over_the_same_rounds_from_the_same_weights(tmp_path):
    out = tmp_path / "ab.json"
    assert winograd_ab.main(["--grids", "32:2", "--threads", "1", "--rounds", "3",
                             "--out", str(out)]) == 0
    (r,) = json.loads(out.read_text())["runs"]
    times = r["step_times_s"]
    assert len(times["onednn"]["step"]) == len(times["winograd"]["step"]) == 3
    assert r["convolutions_swapped"] == 17  # the default U-Net's 3x3 stride-1 layers but one
    assert r["first_loss"]["winograd"] == pytest.approx(r["first_loss"]["onednn"], rel=1e-5)
    assert 0 <= r["faster_rounds"] <= 3
