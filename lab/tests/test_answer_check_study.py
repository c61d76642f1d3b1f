"""lab.tools.answer_check_study on a tiny trained run of the example plugin: both sets of draws
recorded, the flags those of the checkpoint's calibrated threshold, the shares those of the
rows."""
import json
import os
import sys

import numpy as np
import pytest

from tests.in_process import deepfusion_here
from tests.mpi_util import ROOT
from tests.tiny_configs import TINY, variant

FAMILIES = os.path.join(ROOT, "examples", "families")


@pytest.fixture
def plugins(monkeypatch):
    monkeypatch.syspath_prepend(FAMILIES)     # what PYTHONPATH=examples/families does


def test_the_study_flags_by_the_calibrated_threshold_in_and_out_of_family(tmp_path, plugins):
    from deepfusion.engine.checkpoint.store import latest_checkpoint, load_checkpoint
    from lab.tools import answer_check_study

    cfg = tmp_path / "adr.toml"
    cfg.write_text(variant(TINY, 'problem.name="adr:ADR"', "data.eval_samples=6",
                           "train.epochs=3"))
    run = str(tmp_path / "run")
    assert deepfusion_here(["train", str(cfg), "--set", f"run.dir={run}"]).returncode == 0
    threshold = load_checkpoint(latest_checkpoint(run))["meta"]["answer_check"]["threshold"]
    out = tmp_path / "study.json"
    assert answer_check_study.main([run, "--samples", "3", "--set",
                                    "problem.options.max_speed=8", "--widen", "0.5",
                                    "--error", "0.2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["threshold"]["source"] == "calibrated"
    assert res["threshold"]["value"] == pytest.approx(threshold, rel=1e-12)
    inside, outside = res["sets"]["in"], res["sets"]["out"]
    assert outside["options"] == {"max_speed": 8} and outside["widen"] == 0.5
    for s in (inside, outside):
        rows = s["rows"]
        assert s["n"] == len(rows) == 3
        bad = np.array([r["error"] > 0.2 for r in rows])
        flagged = np.array([r["flagged"] for r in rows])
        np.testing.assert_array_equal(flagged, [r["residual"] > threshold for r in rows])
        assert s["bad"] == bad.sum() and s["bad_flagged"] == (bad & flagged).sum()
        assert s["false_alarms"] == (~bad & flagged).sum()
    assert res["pooled"]["n"] == 6
    with pytest.raises(SystemExit):          # the out-of-family draws must differ somehow
        answer_check_study.main([run, "--samples", "2"])
