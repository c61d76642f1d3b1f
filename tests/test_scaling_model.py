"""deepfusion/jobs/model.py and costs.py: alpha-beta allreduce, epoch model and the validation against
the talk."""
from __future__ import annotations

import json
import math

import pytest

from deepfusion.jobs import costs as C
from deepfusion.jobs import model as M
from deepfusion.jobs.render import get_profile, load_profiles

PROFILES = load_profiles()


def test_allreduce_limits():
    n, a, b = 8e6, 1e-6, 12.5e9
    for f in (C.allreduce_ring, C.allreduce_recursive_doubling):
        assert f(1, n, a, b) == 0.0
    assert C.allreduce_time(1, n, a, b) == (0.0, "none")
    assert C.allreduce_ring(2, n, a, b) == pytest.approx(2 * a + n / b)
    assert C.allreduce_recursive_doubling(4, n, a, b) == pytest.approx(2 * (a + n / b))
    # big messages: ring (bandwidth term -> 2 n / beta); tiny messages: recursive doubling (log p latency)
    assert C.allreduce_time(64, n, a, b)[1] == "ring"
    assert C.allreduce_ring(10**6, n, a, b) > 2 * n / b
    assert C.allreduce_time(64, 64, a, b)[1] == "recursive_doubling"
    ts = [C.allreduce_time(p, n, a, b)[0] for p in (2, 4, 8, 16, 64, 256, 1024)]
    assert ts == sorted(ts)


def test_p1_has_no_comm_and_efficiency_is_monotone():
    prof = get_profile("stampede2", PROFILES)
    one = M.epoch_time(1, 1, 0.1, prof, n_samples=4096, global_batch=1024)
    assert one["t_comm"] == 0.0 and one["t_epoch"] == pytest.approx(409.6)
    for name in ("stampede2", "azure-hc44", "aws-c5n", "generic-slurm"):
        rows = M.predict(get_profile(name, PROFILES), t_sample=0.05, t_ref_threads=1)
        assert [r["nodes"] for r in rows][0] == 1 and rows[0]["efficiency"] == pytest.approx(1.0)
        effs = [r["efficiency"] for r in rows]
        times = [r["t_epoch"] for r in rows]
        assert all(e1 >= e2 - 1e-12 for e1, e2 in zip(effs, effs[1:])), name
        assert all(t1 > t2 for t1, t2 in zip(times, times[1:])), name
        assert all(0 < e <= 1 + 1e-12 for e in effs)
    # more parameters -> more communication -> lower efficiency
    small = M.predict(get_profile("aws-c5n", PROFILES), 0.05, params=10**5)[-1]["efficiency"]
    big = M.predict(get_profile("aws-c5n", PROFILES), 0.05, params=10**8)[-1]["efficiency"]
    assert big < small
    # a layout with more ranks than the global batch is infeasible
    assert M.epoch_time(2, 8, 0.1, prof, global_batch=8) is None


def test_amdahl():
    assert C.amdahl(1.0, 1, 1, 0.1) == pytest.approx(1.0)
    assert C.amdahl(1.0, 1, 8, 0.0) == pytest.approx(1 / 8)
    assert C.amdahl(0.5, 2, 2, 0.3) == pytest.approx(0.5)
    assert C.amdahl(1.0, 1, 10**6, 0.1) == pytest.approx(0.1, rel=1e-3)


def test_validation_table_returns_published_numbers():
    rows = M.validation_table()
    times = {(r["cluster"], r["resolution"], r["nodes"]): r for r in rows if "published_s" in r}
    assert len(times) == 15
    for cluster, pub in M.PUBLISHED.items():
        for key, t in pub.items():
            row = times[(cluster, *key)]
            assert row["published_s"] == t
        # calibrated on 1 node: reproduced exactly
        assert times[(cluster, 64, 1)]["predicted_s"] == pytest.approx(pub[(64, 1)], abs=1e-3)
    assert times[("aws-c5n", 64, 1)]["published_s"] == 131.0
    assert times[("stampede2", 256, 4)]["published_s"] == 279.8
    ratios = {(r["cluster"], r["ratio"]): r for r in rows if "ratio" in r}
    assert len(ratios) == 12
    for cluster in M.PUBLISHED:
        two, four = ratios[(cluster, "2n/1n @64")], ratios[(cluster, "4n/1n @64")]
        assert 0.25 <= four["predicted"] < two["predicted"] < 0.51  # monotone, near-ideal
        assert ratios[(cluster, "128/64 @4n")]["predicted"] == pytest.approx(4.0, rel=0.01)
        assert ratios[(cluster, "256/64 @4n")]["predicted"] == pytest.approx(16.0, rel=0.01)
    assert ratios[("stampede2", "4n/1n @64")]["published"] == pytest.approx(19.4 / 67.2, abs=1e-4)
    # Stampede2 is the fastest per core (bare metal), AWS the slowest
    per_core = {c: times[(c, 64, 1)]["core_s_per_sample"] for c in M.PUBLISHED}
    assert per_core["stampede2"] < per_core["azure-hc44"] < per_core["aws-c5n"]
    assert "| stampede2 | 4n/1n @64 |" in M.format_validation(rows)


def test_t_sample_from_sweep(tmp_path):
    # t(T) = 0.02 + 0.08 / T per sample -> serial fraction 0.2
    layouts = [dict(ranks=1, threads=t, global_batch=10, median_time_step=10 * (0.02 + 0.08 / t), allreduce_share=0.0)
               for t in (1, 2, 4)] + [dict(ranks=2, threads=1, global_batch=10, median_time_step=1.0)]
    f = tmp_path / "sweep.json"
    f.write_text(json.dumps(dict(layouts=layouts)))
    fit = M.t_sample_from_sweep(f)
    assert fit["t_ref_threads"] == 1 and fit["t_sample"] == pytest.approx(0.1)
    assert fit["serial_fraction"] == pytest.approx(0.2)


def test_cli(tmp_path, capsys):
    assert M.main(["--t-sample", "0.05", "--params", "2000000", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "model.json").read_text())
    assert set(doc["predictions"]) >= {"stampede2", "aws-c5n", "azure-hc44"}
    assert [r["nodes"] for r in doc["predictions"]["stampede2"]] == [1, 2, 4, 8, 16, 32, 64, 128]
    assert doc["inputs"]["gradient_bytes"] == 8_000_000
    assert (tmp_path / "model.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "2n/1n @64" in out and "131.0" in out
    assert M.main(["--t-sample", "0.05", "--clusters", "nope", "--out", str(tmp_path)]) == 2
    assert not math.isnan(doc["predictions"]["aws-c5n"][-1]["efficiency"])
