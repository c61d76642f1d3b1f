"""lab.tools.lax_oleinik_cost: the closed-form gradient against autograd, timed and weighed."""
from __future__ import annotations

import pytest


def test_the_cost_bench_compares_both_paths(tmp_path):
    """lab.tools.lax_oleinik_cost times and weighs both paths; the closed form keeps one tensor (the
    slope) for backward where autograd keeps its intermediates."""
    import json
    import subprocess
    import sys

    from tests.mpi_util import ROOT

    out = tmp_path / "cost.json"
    p = subprocess.run([sys.executable, "-m", "lab.tools.lax_oleinik_cost", "--grid", "32", "--batch",
                        "1", "--repeats", "1", "--out", str(out)], capture_output=True, text=True,
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr
    rows = {(r["path"], r["smoothing"]): r for r in json.load(open(out))["rows"]}
    assert set(rows) == {(a, s) for a in ("closed", "autograd") for s in (0.2, 0.0)}
    slope_mib = 31 * 32 * 4 / 2**20                       # one float32 (H-1) x W tensor
    for s in (0.2, 0.0):
        assert rows["closed", s]["saved_mib"] == pytest.approx(slope_mib)
        assert rows["autograd", s]["saved_mib"] > 5 * slope_mib
        assert rows["closed", s]["seconds"] > 0
    report = json.load(open(out))
    assert {(r["reach"], r["g"]) for r in report["basin"]} == {
        (r, g) for r in (1, 4) for g in ("value+slope", "value only")}
    assert {r["op"] for r in report["elementwise"]} == {
        "multiply", "torch.where (bool mask)", "lerp (0/1 weight)"}


