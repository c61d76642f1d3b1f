"""lab.tools.upcat_ab at a tiny size: both variants timed over the same rounds (the Ups alone and
the whole step), from the same weights: the same first loss, bit for bit on AVX-512."""
import json
import shutil

import pytest

from lab.tools import upcat_ab


@pytest.mark.skipif(shutil.which("gcc") is None, reason="the fused kernels are built with GCC")
def test_both_variants_over_the_same_rounds_from_the_same_weights(tmp_path):
    out = tmp_path / "ab.json"
    assert upcat_ab.main(["--grids", "32:2", "--threads", "1", "--rounds", "3",
                          "--out", str(out)]) == 0
    (r,) = json.loads(out.read_text())["runs"]
    for times in (r["step_times_s"], r["ups_times_s"]):
        assert len(times["eager"]["step"]) == len(times["fused"]["step"]) == 3
    assert 0 < r["ups_median_s"]["fused"]["step"] < r["step_median_s"]["fused"]["step"]
    assert r["first_loss"]["fused"] == pytest.approx(r["first_loss"]["eager"], rel=1e-6)
    assert 0 <= r["ups_faster_rounds"] <= 3
