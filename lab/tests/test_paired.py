"""lab.tools.paired: two evaluate outputs on the same draws, compared draw by draw."""
import json

import numpy as np
import pytest

from lab.tools import paired


def _eval(path, errs, seed=271828, params=None):
    n = len(errs)
    params = np.arange(2 * n, dtype=float).reshape(n, 2) if params is None else params
    path.write_text(json.dumps({"seed": seed, "n": n, "rel_l2": list(errs),
                                "rel_l2_mean": float(np.mean(errs)), "params": params.tolist()}))
    return str(path)


def test_differences_standard_error_and_wins(tmp_path):
    a = _eval(tmp_path / "a.json", [0.05, 0.06, 0.04, 0.05])
    b = _eval(tmp_path / "b.json", [0.04, 0.05, 0.05, 0.03])
    res = paired.compare(a, b)
    d = np.array([1.0, 1.0, -1.0, 2.0])          # points, A minus B
    assert res["n"] == 4 and res["b_closer_draws"] == 3
    assert res["diff_points_mean"] == pytest.approx(d.mean())
    assert res["diff_points_se"] == pytest.approx(d.std(ddof=1) / 2)
    assert "B better by 0.75 +- 0.63 points" in paired.summary(res)
    assert "B worse by 0.75" in paired.summary(paired.compare(b, a))


def test_other_draws_are_refused_with_the_fix(tmp_path, capsys):
    a = _eval(tmp_path / "a.json", [0.05, 0.06])
    seed = _eval(tmp_path / "s.json", [0.05, 0.06], seed=12345)
    params = _eval(tmp_path / "p.json", [0.05, 0.06], params=np.ones((2, 2)))
    shape = _eval(tmp_path / "q.json", [0.05, 0.06], params=np.ones((2, 3)))
    for other in (seed, params, shape):
        assert paired.main([a, other, "--out", str(tmp_path / "o.json")]) == 2
        assert "the same --seed and --samples" in capsys.readouterr().err
    (tmp_path / "x.json").write_text(json.dumps({"rel_l2_mean": 0.1}))
    assert paired.main([a, str(tmp_path / "x.json")]) == 2
    assert "eval_seed*.json" in capsys.readouterr().err


def test_cli_writes_json_with_its_command(tmp_path, capsys):
    a = _eval(tmp_path / "a.json", [0.05, 0.06, 0.07])
    out = tmp_path / "o.json"
    assert paired.main([a, a, "--out", str(out)]) == 0
    assert "on 3 draws" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["command"].startswith("python -m lab.tools.paired") and res["diff_points_mean"] == 0
