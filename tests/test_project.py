"""deepfusion jobs project: time to accuracy from a batch study and the cluster model."""
import json

import pytest

from deepfusion.jobs import costs

from deepfusion.jobs import project
STUDY = {"arms": [
    {"name": "f_b16_sqrt", "family": "f", "batch": 16, "rule": "sqrt", "steps_to_target": 4000},
    {"name": "f_b64_sqrt", "family": "f", "batch": 64, "rule": "sqrt", "steps_to_target": 1000},
    {"name": "f_b256_sqrt", "family": "f", "batch": 256, "rule": "sqrt", "steps_to_target": 900},
    {"name": "f_b256_lbfgs", "family": "f", "batch": 256, "rule": "lbfgs", "steps_to_target": 300,
     "samples_to_target": 256 * 1200},
    {"name": "g_b16_sqrt", "family": "g", "batch": 16, "rule": "sqrt"}]}


def run(tmp_path, *extra):
    tmp_path.mkdir(exist_ok=True)
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


def test_the_overlapped_all_reduce_waits_only_past_the_backward_pass(tmp_path):
    assert costs.gradient_wait(0.5, 3.0, overlap=False) == 0.5
    assert costs.gradient_wait(0.5, 3.0, overlap=True) == 0.0        # hidden by 2 s of backward
    assert abs(costs.gradient_wait(2.5, 3.0, overlap=True) - 0.5) < 1e-12
    rc, plain = run(tmp_path / "a")
    rc2, over = run(tmp_path / "b", "--overlap")
    assert rc == rc2 == 0
    a, b = (json.loads((d / "project.json").read_text()) for d in (plain, over))
    assert b["inputs"]["overlap"] and not a["inputs"]["overlap"]
    hours = [(x["hours"], y["hours"]) for name in a["projection"]
             for x, y in zip(a["projection"][name], b["projection"][name])]
    assert all(y <= x for x, y in hours) and any(y < x for x, y in hours)


def test_a_family_without_a_reached_target_is_refused(tmp_path, capsys):
    (tmp_path / "study.json").write_text(json.dumps(STUDY))
    rc = project.main(["--study", str(tmp_path / "study.json"), "--family", "g",
                       "--t-sample", "0.01", "--grid", "64x64", "--out", str(tmp_path / "o")])
    assert rc == 2 and "no arm of family 'g'" in capsys.readouterr().err


# -- a recipe's own plan (--config): its batch, its steps, domain splits past the batch --------
RECIPE = """
[problem]
name = "poisson"
grid = [64, 64]
[model]
name = "unet"
options = {depth = 2, base_width = 4}
[data]
n_samples = 16
global_batch = 4
[train]
[[train.levels]]
grid = [32, 32]
steps = 40
[[train.levels]]
grid = [64, 64]
steps = 20
%s
[run]
dir = "%s"
"""


def recipe(tmp_path, level2="", *extra):
    cfg = tmp_path / "recipe.toml"
    cfg.write_text(RECIPE % (level2, tmp_path / "run"))
    argv = ["--config", str(cfg), "--nodes", "1,16,64", "--clusters", "stampede2",
            "--out", str(tmp_path / "out"), *extra]
    return project.main(argv), tmp_path / "out"


def test_a_recipe_keeps_its_batch_and_splits_samples_past_it(tmp_path):
    rc, out = recipe(tmp_path, "", "--t-sample", "0.01,0.04")
    assert rc == 0
    doc = json.loads((out / "project.json").read_text())
    assert [lv["steps"] for lv in doc["inputs"]["levels"]] == [40, 20]
    rows = doc["projection"]["stampede2"]
    for r in rows:
        assert r["batch"] == "4/4" and r["steps"] == 60
        split = r["domain"] or [1]
        per_sample = split[0] * split[-1] if len(split) > 1 else 1
        assert 4 % (r["ranks"] // per_sample) == 0     # the groups divide the recipe's batch
    assert rows[-1]["ranks"] > 4 and rows[-1]["domain"]  # more ranks than samples: a split
    assert rows[-1]["hours"] < rows[0]["hours"]


def test_a_recipe_that_grows_its_network_is_split_and_pays_the_gathers(tmp_path):
    rc, out = recipe(tmp_path, "prolong = true", "--t-sample", "0.01,0.04")
    assert rc == 0
    doc = json.loads((out / "project.json").read_text())
    grown = doc["inputs"]["levels"][1]
    assert grown["chain"] == [[[64, 64], [32, 32], True]] and grown["channels"][1] == 1
    rows = doc["projection"]["stampede2"]
    assert rows[-1]["ranks"] > 4 and rows[-1]["domain"]  # batch 4: 64 nodes split each sample
    plain = json.loads((recipe(tmp_path, "", "--t-sample", "0.01,0.04")[1]
                        / "project.json").read_text())["projection"]["stampede2"]
    assert all(r["hours"] > q["hours"] for r, q in zip(rows, plain) if r["domain"])
    assert all(r["hours"] == q["hours"] for r, q in zip(rows, plain) if not r["domain"])


def test_an_lbfgs_recipe_counts_its_loss_evaluations(tmp_path):
    """Each L-BFGS step evaluates the loss (and all-reduces the gradient) 1 + lbfgs_max_iter
    times at least: the same layouts, twice the time with one iteration per step."""
    read = lambda out: json.loads((out / "project.json").read_text())  # noqa: E731
    adam = read(recipe(tmp_path, "", "--t-sample", "0.01,0.04")[1])
    rc, out = recipe(tmp_path, "", "--t-sample", "0.01,0.04", "--set", 'optim.name="lbfgs"',
                     "--set", "optim.lbfgs_max_iter=1")
    assert rc == 0
    lbfgs = read(out)
    assert [lv["evals"] for lv in lbfgs["inputs"]["levels"]] == [2, 2]
    for a, b in zip(adam["projection"]["stampede2"], lbfgs["projection"]["stampede2"]):
        assert b["hours"] == pytest.approx(2 * a["hours"], rel=1e-12) and b["domain"] == a["domain"]


def test_the_gathers_of_a_split_prolonged_level_are_two_allgathers_and_an_allreduce():
    from deepfusion.jobs.costs import allreduce_time
    from deepfusion.jobs.project_recipe import gather_time

    lv = {"chain": [[[64, 64], [32, 32], True]], "channels": [2, 1]}
    alpha, beta = 1e-6, 1e9
    fields, answer = 4.0 * 2 * 64 * 64, 4.0 * 1 * 32 * 32
    want = 2 * (2 * alpha) + 0.75 * (fields + answer) / beta \
        + 2 * allreduce_time(2, answer, alpha, beta)[0]
    assert gather_time(lv, (2, 2), alpha, beta) == pytest.approx(want, rel=1e-12)
    lv["chain"][0][2] = False                            # a frozen inner network: no backward
    assert gather_time(lv, (2, 2), alpha, beta) == pytest.approx(
        want - 2 * allreduce_time(2, answer, alpha, beta)[0], rel=1e-12)
    assert gather_time({"chain": [], "channels": [2, 1]}, (2, 2), alpha, beta) == 0


@pytest.mark.full
def test_a_recipe_is_probed_when_no_sample_time_is_given(tmp_path):
    rc, out = recipe(tmp_path)
    assert rc == 0
    doc = json.loads((out / "project.json").read_text())
    assert len(doc["inputs"]["t_sample"]) == 2 and min(doc["inputs"]["t_sample"]) > 0
    assert "probe" in doc["inputs"]["measured"]


def test_bad_recipe_command_lines_are_refused(tmp_path, capsys):
    rc, _ = recipe(tmp_path, "", "--t-sample", "0.01")
    assert rc == 2 and "one per visit" in capsys.readouterr().err
    rc, _ = recipe(tmp_path, "", "--study", "s.json")
    assert rc == 2 and "not both" in capsys.readouterr().err
    assert project.main(["--family", "f", "--out", str(tmp_path / "o")]) == 2
    assert "--study, --grid, --t-sample must be given" in capsys.readouterr().err


def test_projections_are_combined_side_by_side(tmp_path, capsys):
    rc, out = recipe(tmp_path, "", "--t-sample", "0.01,0.04")
    assert rc == 0
    (tmp_path / "study").mkdir()
    rc, study = run(tmp_path / "study", "--overlap")
    assert rc == 0
    (study / "project.json").rename(tmp_path / "study" / "project.json")
    both = [str(out / "project.json"), str(tmp_path / "study" / "project.json")]
    assert project.main(["--combine", *both, "--out", str(tmp_path / "sum")]) == 0
    text = (tmp_path / "sum" / "summary.md").read_text()
    # named by the directories they were written to
    assert "`out`" in text and "`study (overlap)`" in text and (tmp_path / "sum" / "summary.png").exists()
    assert text.splitlines()[0].endswith("| 1 nodes | 4 nodes | 16 nodes | 64 nodes |")
    # then what limits each at 16 nodes, one row per projection and cluster, as project.json says
    limited = [ln for ln in text.splitlines() if ln.startswith("| `out` | stampede2 | 16 |")]
    lim = json.loads((out / "project.json").read_text())["limits"]["stampede2"]
    assert len(limited) == 1 and f"{lim['speedup']:.1f}x" in limited[0]
    assert limited[0].rstrip(" |").endswith(lim["limited_by"] or "reaches the goal")
    (tmp_path / "bad.json").write_text("{}")
    assert project.main(["--combine", str(tmp_path / "bad.json"), "--out", str(tmp_path)]) == 2
    assert "not a project.json" in capsys.readouterr().err


# -- the all-reduce from a measurement (--measured) and what limits the speed-up -------------
def bench_json(path, *, t_full=0.008, move=0.002, hooks=0.001, compute=0.06, wait=0.003):
    """A bench JSON's overlap part (bench/comm_bench.py) with per-rank seconds: without
    overlap the whole transfer ``t_full`` is moved after backward; with it ``move`` + ``hooks``
    stay exposed. Each rank waits ``wait`` in one of the two modes' records."""
    def rec(mv, pr):
        return {"step_s": compute + mv + wait, "compute_s": compute, "bytes": 5_000_000,
                "wait_s": [2 * wait, 0.0], "move_s": [mv, mv], "progress_s": [pr, pr],
                "exposed_s": [2 * wait + mv, mv], "enter_s": [0.0, 0.0],
                "step_s_rounds": [compute + mv + wait] * 3}
    path.write_text(json.dumps({"comm": {"overlap": {"no_overlap": rec(t_full, 0.0),
                                                     "overlap": rec(move, hooks)}}}))
    return str(path)


def test_the_overlap_and_the_skew_are_taken_from_a_bench_measurement(tmp_path, capsys):
    measured = bench_json(tmp_path / "bench.json")
    rc, assumed = run(tmp_path / "a", "--overlap")
    rc2, got = run(tmp_path / "b", "--overlap", "--measured", measured)
    assert rc == rc2 == 0
    a, b = (json.loads((d / "project.json").read_text()) for d in (assumed, got))
    m = b["inputs"]["allreduce_model"]
    # h = (transfer without overlap - what stayed exposed with it) / compute; skew = wait / compute
    assert m["hidden_share"] == pytest.approx((0.008 - 0.003) / 0.06)
    assert m["skew_share"] == pytest.approx(0.003 / 0.06)
    assert m["overlap_from"] == "measured" and m["sources"] == [measured]
    assert a["inputs"]["allreduce_model"]["overlap_from"] == "assumed bound"
    assert "measured" in b["inputs"]["allreduce"] and "bound" in a["inputs"]["allreduce"]
    # less hidden than the 2/3 bound, and the skew on top: never sooner than assumed
    for name in a["projection"]:
        for x, y in zip(a["projection"][name], b["projection"][name]):
            assert y["hours"] >= x["hours"]
    out = capsys.readouterr().out
    assert "all-reduce overlapped: h = 0.0833" in out and "measured" in out
    # a bench.json from before the per-rank accounting, or without its comm part: refused
    doc = json.loads((tmp_path / "bench.json").read_text())
    doc["comm"]["overlap"]["overlap"]["wait_s"] = None
    (tmp_path / "old.json").write_text(json.dumps(doc))
    assert run(tmp_path / "c", "--measured", str(tmp_path / "old.json"))[0] == 2
    assert "run make bench again" in capsys.readouterr().err
    (tmp_path / "none.json").write_text(json.dumps({"step": {}}))
    assert run(tmp_path / "d", "--measured", str(tmp_path / "none.json"))[0] == 2
    assert "no 'overlap' part" in capsys.readouterr().err


def test_every_projection_says_what_limits_it_at_16_nodes(tmp_path):
    rc, out = run(tmp_path, "--measured", bench_json(tmp_path / "bench.json"))
    assert rc == 0
    doc = json.loads((out / "project.json").read_text())
    assert set(doc["limits"]) == set(doc["projection"])
    for name, lim in doc["limits"].items():
        row = doc["projection"][name][-1]
        assert lim["nodes"] == 16 == row["nodes"] and lim["speedup"] == row["speedup"]
        assert sum(lim["shares"].values()) == pytest.approx(1.0)
        assert lim["shares"]["skew"] > 0 and lim["shares"]["halo"] == 0   # measured; no split
        assert lim["speedup_if_free"] >= lim["speedup"]
        assert lim["limited_by"] in (None, "compute", "halo", "allreduce", "skew")
        assert (lim["limited_by"] is None) == (lim["speedup"] >= 10)
    text = (out / "project.md").read_text()
    assert "stampede2 at 16 nodes:" in text and "arrival skew" in text


def test_a_split_recipe_is_limited_by_its_halo_or_compute_and_says_so(tmp_path):
    rc, out = recipe(tmp_path, "", "--t-sample", "0.01,0.04")
    assert rc == 0
    doc = json.loads((out / "project.json").read_text())
    lim, row = doc["limits"]["stampede2"], doc["projection"]["stampede2"][1]
    assert doc["inputs"]["nodes"] == [1, 16, 64] and lim["nodes"] == row["nodes"] == 16
    assert row["domain"] and lim["shares"]["halo"] > 0   # 16 nodes split the batch-4 samples
    assert lim["shares"]["skew"] == 0                    # not measured: not modelled
    assert lim["limited_by"] in ("compute", "halo", "allreduce")
    assert lim["shares"] == row["parts"] and row["parts"]["compute"] > 0


def test_a_measured_run_directory_gives_its_one_mode(tmp_path, capsys):
    """A run without overlap measures the skew; the overlap stays the assumed bound (said)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    recs = [{"kind": "step", "step": s, "time_forward": 0.02, "time_backward": 0.04,
             "allreduce_overlap": False, "allreduce_bytes": 800,
             "allreduce_wait_s": [0.006, 0.0], "allreduce_move_s": [0.002, 0.002],
             "allreduce_progress_s": [0.0, 0.0], "allreduce_exposed_s": [0.008, 0.002],
             "allreduce_enter_s": [0.0, 0.0]} for s in (1, 2, 3)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs)
                                           + '{"kind": "st')   # a line being written
    rc, out = run(tmp_path / "p", "--overlap", "--measured", str(run_dir))
    assert rc == 0
    m = json.loads((out / "project.json").read_text())["inputs"]["allreduce_model"]
    assert m["skew_share"] == pytest.approx(0.003 / 0.06)
    assert m["overlap_from"] == "assumed bound" and m["hidden_share"] == pytest.approx(2 / 3)
    assert "no step with overlap" in m["note"]
    # refused: nothing there, or a run without the accounting (one rank, or switched off)
    assert run(tmp_path / "q", "--measured", str(tmp_path / "nowhere"))[0] == 2
    assert "no such run directory or file" in capsys.readouterr().err
    for r in recs:
        r.pop("allreduce_wait_s")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert run(tmp_path / "q", "--measured", str(run_dir))[0] == 2
    assert "parallel.allreduce_stats" in capsys.readouterr().err
