"""lab.tools.fused_ab at a tiny size: eager and fused steps timed over the same rounds, from the
same weights (the same first loss to float32 rounding)."""
import json
import shutil

import pytest

from lab.tools import fused_ab


@pytest.mark.skipif(shutil.which("gcc") is None, reason="the fused kernel is built with GCC")
def test_both_steps_over_the_same_rounds_from_the_same_weights(tmp_path):
    out = tmp_path / "ab.json"
    assert fused_ab.main(["--grids", "32:2", "--threads", "1", "--rounds", "3",
                          "--out", str(out)]) == 0
    (r,) = json.loads(out.read_text())["runs"]
    for k in ("eager", "fused"):
        assert len(r["times_s"][k]["step"]) == len(r["times_s"][k]["forward"]) == 3
        assert 0 < r["median_s"][k]["forward"] < r["median_s"][k]["step"]
    assert r["first_loss"]["fused"] == pytest.approx(r["first_loss"]["eager"], rel=1e-4)
    assert 0 <= r["fused_faster_rounds"] <= 3
