"""deepfusion jobs project: time to accuracy from a batch study and the cluster model."""
import json

from jobs import project

STUDY = {"arms": [
    {"name": "f_b16_sqrt", "family": "f", "batch": 16, "rule": "sqrt", "steps_to_target": 4000},
    {"name": "f_b64_sqrt", "family": "f", "batch": 64, "rule": "sqrt", "steps_to_target": 1000},
    {"name": "f_b256_sqrt", "family": "f", "batch": 256, "rule": "sqrt", "steps_to_target": 900},
    {"name": "f_b256_lbfgs", "family": "f", "batch": 256, "rule": "lbfgs", "steps_to_target": 300,
     "samples_to_target": 256 * 1200},
    {"name": "g_b16_sqrt", "family": "g", "batch": 16, "rule": "sqrt"}]}


def run(tmp_path, *extra):
    (tmp_path / "study.json").write_text(json.dumps(STUDY))
    argv = ["--study", str(tmp_path / "study.json"), "--family", "f", "--t-sample", "0.01",
            "--grid", "64x64", "--nodes", "1,4,16", "--out", str(tmp_path / "out"), *extra]
    rc = project.main(argv)
    return rc, tmp_path / "out"


def test_steps_count_line_search_evaluations_and_take_the_best_rule():
    steps = project.steps_to_target(STUDY, "f")
    assert steps == {16: {"steps": 4000, "rule": "sqrt"}, 64: {"steps": 1000, "rule": "sqrt"},
                     256: {"steps": 900, "rule": "sqrt"}}     # L-BFGS: 1200 evaluations > 900


def test_more_nodes_take_a_larger_batch_and_finish_sooner(tmp_path):
    rc, out = run(tmp_path)
    assert rc == 0
    doc = json.loads((out / "project.json").read_text())
    for name, rows in doc["projection"].items():
        assert [r["nodes"] for r in rows] == [1, 4, 16]
        assert rows[0]["speedup"] == 1.0
        for r in rows:     # every chosen layout fills the node and its groups divide the batch
            assert r["ranks_per_node"] * r["threads_per_rank"] <= 48
            assert r["batch"] % r["ranks"] == 0
            assert abs(r["hours"] * 3600 - r["steps"] * r["t_step"]) < 1e-9
        assert rows[-1]["hours"] < rows[0]["hours"]
        assert [r["batch"] for r in rows] == sorted(r["batch"] for r in rows)
    assert (out / "project.png").exists() and "hours to target" in (out / "project.md").read_text()


def test_a_family_without_a_reached_target_is_refused(tmp_path, capsys):
    (tmp_path / "study.json").write_text(json.dumps(STUDY))
    rc = project.main(["--study", str(tmp_path / "study.json"), "--family", "g",
                       "--t-sample", "0.01", "--grid", "64x64", "--out", str(tmp_path / "o")])
    assert rc == 2 and "no arm of family 'g'" in capsys.readouterr().err
