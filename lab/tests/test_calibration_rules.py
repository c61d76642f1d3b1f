"""lab.tools.calibration_rules: both rules calibrated on the same validation draws, each
threshold's flags counted on every set of a study as the rows say."""
import json

import numpy as np
import pytest


def test_both_rules_flag_the_study_rows_by_their_own_threshold(tmp_path):
    from deepfusion.engine.predict.calibration import calibrate
    from lab.tools import calibration_rules

    rng = np.random.default_rng(0)
    e = np.exp(rng.uniform(np.log(0.06), np.log(0.3), 16))        # all bad, residual ~ e^0.5
    r = 0.5 * e ** 0.5 * np.exp(0.05 * rng.standard_normal(16))
    run = tmp_path / "run"
    run.mkdir()
    (run / "eval.json").write_text(json.dumps({"residual": r.tolist(), "rel_l2": e.tolist(),
                                               "seed": 12345}))
    test_e = np.array([0.015, 0.02, 0.03, 0.1, 0.2])
    rows = [{"error": float(x), "residual": float(0.5 * x ** 0.5)} for x in test_e]
    study = tmp_path / "study.json"
    study.write_text(json.dumps({"error": 0.05, "sets": {"in": {"rows": rows}}}))
    out = tmp_path / "rules.json"
    assert calibration_rules.main([str(run), str(study), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["validation_seed"] == 12345
    for name, slope in calibration_rules.RULES.items():
        rule = res["rules"][name]
        t = calibrate(r, e, slope=slope)["threshold"]
        assert rule["threshold"] == pytest.approx(t)
        got = rule["sets"]["in"]
        flagged = 0.5 * test_e ** 0.5 > t
        assert (got["bad"], got["good"]) == (2, 3)
        assert got["bad_flagged"] == flagged[3:].sum()
        assert got["false_alarms"] == flagged[:3].sum()
        assert rule["sets"]["validation"]["bad"] == 16
    # the ratio rule flags every good answer of this law, the fitted one none
    assert res["rules"]["ratio (slope 1)"]["sets"]["in"]["false_alarms"] == 3
    assert res["rules"]["fitted slope"]["sets"]["in"]["false_alarms"] == 0
