"""Smoke tests of the benchmark (bench/run.py and parts) at tiny sizes: the JSON has its fields.

Never a timing assertion: the numbers depend on the machine and its load.
"""
import json
import os

import pytest

from bench import comm_bench, run


def test_bench_run_quick_writes_json_with_fields(tmp_path):
    out = tmp_path / "out"
    assert run.main(["--quick", "--out", str(out), "--skip", "comm"]) == 0
    res = json.loads((out / "bench.json").read_text())
    assert {"machine", "step", "memory", "goals", "loadavg_end"} <= set(res)
    assert len(res["machine"]["loadavg"]) == 3
    (r,) = res["step"]["runs"]
    assert r["flops_per_step"] > 0 and r["gemm_gflops"] > 0
    assert {"plain", "deepfusion", "deepfusion_nchw"} <= set(r["configs"])
    for v in r["configs"].values():
        assert {"step_s", "cpu_s", "samples_per_s", "gflops", "gemm_ratio", "gemm_ratio_cpu",
                "speedup_vs_plain"} <= set(v)
    rows = res["memory"]["rows"]
    assert {row["checkpoint_levels"] for row in rows} == {False, True}
    for row in rows:
        assert row["peak_rss_mb"] > 0 and "step_increase_mb" in row
    (inf,) = res["memory"]["inference"]
    assert inf["size"] == 64 and inf["peak_rss_mb"] > 0 and inf["forward_s"] > 0
    assert any(k.startswith("speedup_vs_plain") for k in res["goals"])
    assert "goal" in run.table(res)


@pytest.mark.mpi
def test_comm_bench_tiny_has_fields():
    res = comm_bench.run(grid=32, batch=4, steps=1, repeats=1, sizes_mb="0.5",
                         bucket_mbs="0.25,4", repeats_ar=2, log=lambda *a: None)
    assert "error" not in res, res.get("error")
    assert {"mpi_ms", "gloo_ms", "gloo_over_mpi"} <= set(res["allreduce"]["0.5"])
    assert set(res["buckets"]["bucket_mb"]) == {"0.25", "4"}
    assert {"overlap", "no_overlap"} == set(res["overlap"])
    assert res["overlap"]["overlap"]["allreduce_share"] >= 0
    lay = res["layout"]
    assert "P1xT2" in lay and "P2xT1" in lay and "P2xT1_speedup" in lay


def test_ablation_bench_records_eval_of_each_variant(tmp_path):
    from bench import ablation_bench

    out = tmp_path / "abl.json"
    assert ablation_bench.main(["--out", str(out), "--only", "poisson_residual_central",
                                "--poisson-steps", "2", "--threads", "1",
                                "--runs", str(tmp_path / "runs")]) == 0
    (rec,) = json.loads(out.read_text())["results"]
    assert rec["name"] == "poisson_residual_central" and rec["steps"] == 2
    assert 'problem.options.stencil="central"' in rec["overrides"]
    assert rec["n"] == 16 and 0 < rec["rel_l2_mean"] <= rec["rel_l2_max"]
    with pytest.raises(SystemExit):
        ablation_bench.main(["--only", "nope", "--out", str(out)])
