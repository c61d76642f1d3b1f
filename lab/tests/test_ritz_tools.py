"""lab.tools.ritz_partition and lab.tools.ritz_variants on a tiny Ritz run: the partition
answer's error and cost against m, and the rejected cheaper answers measured."""
import json

from lab.tools import ritz_partition, ritz_variants
from tests.test_engine_mpi import train
from tests.test_evaluate import RITZ


def test_ritz_tools_on_a_tiny_run(tmp_path, cli):
    cfg = tmp_path / "ritz.toml"
    cfg.write_text(RITZ)
    run = str(tmp_path / "run")
    assert train(0, str(cfg), run, "train.max_steps=4", "data.test_samples=3").returncode == 0
    ref = str(tmp_path / "ref.h5")
    assert cli(["solve", "--problem", "darcy", "--set", 'problem.options.family="fine-scale"',
                   "--grid", "16x16", "--samples", "3", "--out", ref])[0] == 0
    out = str(tmp_path / "rp.json")
    assert ritz_partition.main([run, ref, "--partitions", "0,2", "--samples", "3", "--control",
                                "--threads", "1", "--out", out]) == 0
    r = json.load(open(out))
    assert [row["m"] for row in r["partitions"]] == [0, 2] and r["samples"] == 3
    assert r["partitions"][1]["unknowns"] == 2 * 9 and len(r["control_constant_field"]) == 1
    out = str(tmp_path / "rv.json")                  # the rejected cheaper answers, measured
    assert ritz_variants.main([run, ref, "--samples", "2", "--partitions", "2", "--fields", "1,2",
                               "--threads", "1", "--out", out]) == 0
    moved = {v["name"]: max(v["moved"]) for v in json.load(open(out))["variants"]}
    assert moved["float64"] == 0 and moved["float32_features"] < 1e-5
    # K' = K combinations span the K fields, so they give the problem's answer
    assert moved["fields_2"] < 1e-5 < moved["fields_1"]   # 1e-5: the solve's 1e-7 shift
