"""bench.fem_bench: the classical Darcy solvers it times solve the reference solver's system."""
import json
import os

import numpy as np
import pytest
import torch

from bench import fem_bench
from diffnet.problems import get_problem

N, S = 32, 2


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    """The benchmark's JSON at N = 32, S = 2 (its thread settings undone afterwards)."""
    out = tmp_path_factory.mktemp("fem") / "fem.json"
    saved_env = {k: os.environ.get(k) for k in fem_bench.THREAD_VARS}
    saved_threads = torch.get_num_threads()
    try:
        fem_bench.main(["--sizes", str(N), "--samples", str(S), "--rtols", "1e-8,1e-2",
                        "--out", str(out)])
    finally:
        torch.set_num_threads(saved_threads)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return json.loads(out.read_text())


def row(res, method, rtol=None):
    (r,) = [r for r in res["rows"] if r["method"] == method and r["rtol"] == rtol]
    return r


def test_direct_is_the_reference_solution():
    p = get_problem("darcy", grid=(N, N), family="fine-scale")
    params = p.sample_params(271828, range(S))
    for i in range(S):
        _, u, _ = fem_bench.solve_draw(p, fem_bench.draw_nu(p, params, i), [1e-8], 100)
        np.testing.assert_allclose(u, p.reference_solution(params[i], "direct"),
                                   rtol=1e-12, atol=1e-15)


def test_amg_matches_direct_with_setup_and_solve_apart(result):
    d = row(result, "direct")
    assert d["setup_s"] > 0 and d["solve_s"] > 0 and d["rel_l2_vs_direct"] == 0.0
    tight, loose = row(result, "amg", 1e-8), row(result, "amg", 1e-2)
    assert tight["rel_l2_vs_direct_max"] < 1e-6 and tight["converged"]
    assert tight["setup_s"] > 0 and tight["solve_s"] > 0 and tight["iterations"] > 0
    assert loose["iterations"] <= tight["iterations"]
    assert tight["draws"] == S


def test_reused_setup_converges(result):
    r = row(result, "amg_reused", 1e-8)
    assert r["draws"] == S - 1 and r["converged"] and r["iterations"] > 0
    assert r["rel_l2_vs_direct_max"] < 1e-5
    assert r["setup_s"] == pytest.approx(result["grids"][0]["amg_setup_s_draw0"])
    assert r["solve_s"] > 0


def test_json_layout(result):
    for key in ("command", "family", "seed", "samples", "rtols", "maxiter", "threads", "times",
                "machine", "grids", "rows", "peak_rss_mib"):
        assert key in result, key
    assert result["family"] == "fine-scale" and result["samples"] == S
    (g,) = result["grids"]
    assert g["N"] == N and g["unknowns"] == (N - 2) ** 2 and g["assemble_s"] > 0
    assert g["peak_rss_mib_after"] > 0 and result["peak_rss_mib"] > 0
    assert result["command"].startswith("python -m bench.fem_bench --sizes 32")
    methods = [(r["method"], r["rtol"]) for r in result["rows"]]
    assert methods == [("direct", None), ("amg", 1e-8), ("amg", 1e-2),
                       ("amg_reused", 1e-8), ("amg_reused", 1e-2)]
    for r in result["rows"]:
        for key in ("N", "setup_s", "solve_s", "total_s", "iterations", "iterations_max",
                    "rel_l2_vs_direct", "rel_l2_vs_direct_max", "residual_max", "converged"):
            assert key in r, key
