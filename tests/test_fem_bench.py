"""bench.fem_bench: the classical Darcy solvers it times solve the reference solver's system;
its ``--export`` files, and bench/hypre_bench.py solving them where petsc4py is found."""
import glob
import json
import os
import subprocess
import sys

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
    export = out.parent / "systems"
    run_main(["--sizes", str(N), "--samples", str(S), "--rtols", "1e-8,1e-2", "--out", str(out),
              "--export", str(export)])
    res = json.loads(out.read_text())
    res["export_dir"] = str(export)
    return res


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
    assert d["setup_s"] > 0 and d["solve_s"] > 0 and d["rel_l2_vs_reference"] == 0.0
    tight, loose = row(result, "amg", 1e-8), row(result, "amg", 1e-2)
    assert tight["rel_l2_vs_reference_max"] < 1e-6 and tight["converged"]
    assert tight["setup_s"] > 0 and tight["solve_s"] > 0 and tight["iterations"] > 0
    assert loose["iterations"] <= tight["iterations"]
    assert tight["draws"] == S


def test_reused_setup_converges(result):
    r = row(result, "amg_reused", 1e-8)
    assert r["draws"] == S - 1 and r["converged"] and r["iterations"] > 0
    assert r["rel_l2_vs_reference_max"] < 1e-5
    assert r["setup_s"] == pytest.approx(result["grids"][0]["amg_setup_s_draw0"])
    assert r["solve_s"] > 0


def test_json_layout(result):
    assert result["problem"] == "darcy" and result["reference"] == "direct"
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
                    "rel_l2_vs_reference", "rel_l2_vs_reference_max", "residual_max", "converged"):
            assert key in r, key


def test_export_holds_each_draws_system_and_direct_solution(result):
    import scipy.sparse as sp

    p = get_problem("darcy", grid=(N, N), family="fine-scale")
    params = p.sample_params(271828, range(S))
    paths = sorted(glob.glob(os.path.join(result["export_dir"], "*.npz")))
    assert [os.path.basename(x) for x in paths] == [f"N{N}_draw{i}.npz" for i in range(S)]
    for i, path in enumerate(paths):
        z = np.load(path)
        n = z["b"].size
        a = sp.csr_matrix((z["data"], z["indices"], z["indptr"]), shape=(n, n))
        u = z["u_ref"]
        assert str(z["reference"]) == "direct"
        np.testing.assert_allclose(u, p.reference_solution(params[i], "direct"), rtol=1e-12,
                                   atol=1e-15)
        np.testing.assert_allclose(a @ u[z["free"]], z["b"], rtol=1e-9, atol=1e-12)
        assert z["free"].sum() == n and not z["u_full"][z["free"]].any()


def petsc_python():
    """(interpreter, env) of a Python that imports petsc4py, or None: this one first, then
    Debian's /usr/bin/python3 with its petsc4py directory on PYTHONPATH."""
    candidates = [(sys.executable, dict(os.environ))]
    for d in glob.glob("/usr/lib/petscdir/*/*-real/lib/python3/dist-packages"):
        candidates.append(("/usr/bin/python3", {**os.environ, "PYTHONPATH": d}))
    for exe, env in candidates:
        ok = os.path.exists(exe) and subprocess.run(
            [exe, "-c", "import petsc4py, numpy"], env=env, capture_output=True).returncode == 0
        if ok:
            return exe, env
    return None


HYPRE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                     "hypre_bench.py")


def test_boomeramg_solves_the_exported_systems(result, tmp_path):
    found = petsc_python()
    if found is None:
        pytest.skip("no Python with petsc4py here (Debian: apt-get install "
                    "python3-petsc4py-real3.18); bench/hypre_bench.py is not run")
    exe, env = found
    out = tmp_path / "hypre.json"
    proc = subprocess.run([exe, HYPRE, result["export_dir"], "--rtols", "1e-8,1e-1",
                           "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    tight, loose = res["rows"]
    assert (tight["N"], tight["rtol"], tight["draws"]) == (N, 1e-8, S)
    assert tight["converged"] and tight["rel_l2_vs_reference_max"] < 1e-6
    assert tight["residual_max"] <= 1e-8 and loose["residual_max"] <= 1e-1
    assert loose["iterations"] <= tight["iterations"] and tight["setup_s"] > 0
    assert res["copies"] == 1 and "node_s_per_answer" not in tight
    proc = subprocess.run([exe, HYPRE, result["export_dir"], "--rtols", "1e-8", "--copies", "2",
                           "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    (pair,) = json.loads(out.read_text())["rows"]
    assert pair["copies"] == 2 and pair["node_s_per_answer"] == pytest.approx(pair["total_s"] / 2)
    assert pair["rel_l2_vs_reference"] == pytest.approx(tight["rel_l2_vs_reference"])


def test_hypre_bench_names_what_is_missing(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, HYPRE, *a], capture_output=True,  # noqa: E731
                                    text=True, timeout=60)
    proc = run(str(tmp_path / "nowhere"))
    assert proc.returncode == 2 and "bench.fem_bench ... --export DIR" in proc.stderr
    proc = run(str(tmp_path))
    assert proc.returncode == 1 and "no N{N}_draw{i}.npz" in proc.stderr


def run_main(argv):
    """fem_bench.main with its thread settings undone afterwards."""
    saved_env = {k: os.environ.get(k) for k in fem_bench.THREAD_VARS}
    saved_threads = torch.get_num_threads()
    try:
        return fem_bench.main(argv)
    finally:
        torch.set_num_threads(saved_threads)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_3d_against_a_tight_amg_reference(tmp_path):
    out, export = tmp_path / "f3.json", tmp_path / "sys"
    run_main(["--problem", "poisson3d", "--sizes", "12", "--samples", "2", "--seed", "777",
              "--reference", "amg", "--rtols", "1e-10,1e-1", "--out", str(out),
              "--export", str(export)])
    res = json.loads(out.read_text())
    assert res["problem"] == "poisson3d" and res["reference"] == "amg-cg 1e-12"
    assert res["family"] is None and res["grids"][0]["unknowns"] == 12 * 12 * 10
    ref = row(res, "amg_reference")
    assert ref["residual_max"] <= 1e-12 and ref["rel_l2_vs_reference"] == 0.0
    tight = row(res, "amg", 1e-10)
    assert tight["rel_l2_vs_reference_max"] < 1e-8
    p = get_problem("poisson3d", grid=(12, 12, 12))
    params = p.sample_params(777, range(2))
    z = np.load(export / "N12_draw1.npz")
    assert str(z["reference"]) == "amg_reference"
    np.testing.assert_allclose(z["u_ref"], p.reference_solution(params[1], "direct"),
                               rtol=1e-9, atol=1e-11)


def test_a_problem_without_a_diffusion_system_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        run_main(["--problem", "burgers", "--sizes", "8"])
    assert e.value.code == 2
    assert "choose from darcy" in capsys.readouterr().err
