"""lab.tools.adam_ab at a tiny size: both Adam paths timed over the same rounds, and the fused
kernel switched back on afterwards."""
import json

from deepfusion.engine.train import firstorder
from lab.tools import adam_ab


def test_both_paths_over_the_same_rounds_and_the_kernel_restored(tmp_path):
    out = tmp_path / "ab.json"
    assert adam_ab.main(["--grids", "32:2", "--threads", "1", "--rounds", "3",
                         "--out", str(out)]) == 0
    (r,) = json.loads(out.read_text())["runs"]
    for k in ("foreach", "fused"):
        assert len(r["times_s"][k]["step"]) == len(r["times_s"][k]["optimizer"]) == 3
        assert 0 < r["median_s"][k]["optimizer"] < r["median_s"][k]["step"]
    assert 0 <= r["fused_optimizer_faster_rounds"] <= 3
    assert firstorder.FUSED_ADAM is not None
