"""The coarse correction (``diffnet.problems.coarse_correction``, ``problem.correction``): the
loss's minimiser over an answer's rescalings on a coarse partition. It recovers the discrete
solution exactly when the answer is the solution divided by a field of the partition's span,
never raises the loss, works in 3-D, refuses a non-quadratic loss and cells the grid cannot
hold; the engine answers with it where the run or the command asks (validation, evaluate,
infer, the Python API) and refuses it with a domain split."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from deepfusion.config import ConfigError, load_config
from diffnet.problems import coarse_correction, get_problem
from diffnet.problems.contract.correction import partition_hats
from diffnet.problems.contract.loss_residual import free_nodes
from tests.in_process import deepfusion_here
from tests.tiny_configs import TINY, variant


def draws(p, n):
    params = p.sample_params(0, range(n))
    x = p.build_input(params, torch.float64)
    ref = torch.as_tensor(np.stack([p.reference_solution(q) for q in params]))[:, None]
    return x, ref


def loss(p, u, x):
    return sum(p.loss_terms(u, x).values())


@pytest.mark.parametrize("grid,cells", [((17, 17), 2), ((17, 13), 4), ((9, 9, 9), 2)])
def test_hats_are_a_partition_of_unity(grid, cells):
    h = partition_hats(grid, cells)
    assert h.shape == ((cells + 1) ** len(grid), *grid)
    assert torch.allclose(h.sum(0), torch.ones(grid, dtype=torch.float64), atol=1e-14)
    assert float(h.min()) >= 0.0


@pytest.mark.parametrize("name,grid,cells", [("poisson", (17, 17), 2), ("poisson", (17, 17), 4),
                                             ("poisson3d", (9, 9, 9), 2)])
def test_the_solution_off_by_a_factor_and_a_term_of_the_span_is_recovered(name, grid, cells):
    """u = lift + (ref - lift - e) / c, c and e fields of the coarse hats' span: ref - u =
    (c - 1) (u - lift) + e is in the correction's space, so the loss's minimiser over it is
    the solution."""
    p = get_problem(name, grid=grid)
    x, ref = draws(p, 2)
    free, lift = free_nodes(p, x)
    hats = partition_hats(grid, cells)
    c = 1 + 0.3 * hats[len(hats) // 2] - 0.2 * hats[0]        # in the span, positive
    e = 0.05 * (hats[1] - hats[-2]) * free
    for u in (lift + (ref - lift) / c, ref + e, lift + (ref - lift - e) / c):
        fixed = coarse_correction(p, u, x, cells)
        assert float((u - ref).abs().max()) > 1e-2
        assert float((fixed - ref).abs().max()) < 1e-6 * float(ref.abs().max())


def test_the_loss_never_rises_and_a_bad_answer_is_kept():
    p = get_problem("poisson", grid=(17, 17))
    x, _ = draws(p, 3)
    torch.manual_seed(0)
    u = p.answer(0.1 * torch.randn(3, 1, 17, 17, dtype=torch.float64), x)
    u[2, 0, 5, 5] = float("nan")
    fixed = coarse_correction(p, u, x, 4)
    assert bool((loss(p, fixed[:2], x[:2]) < loss(p, u[:2], x[:2])).all())
    assert torch.isnan(fixed[2]).any() and torch.equal(fixed[2].isnan(), u[2].isnan())
    assert fixed.dtype == u.dtype


def test_a_float32_answer_under_inference_mode_is_corrected_in_its_dtype():
    p = get_problem("poisson", grid=(17, 17))
    x, ref = draws(p, 1)
    with torch.inference_mode():
        u = p.impose(ref * 1.1, x).float()     # the walls hold the data: a factor off inside
        fixed = coarse_correction(p, u, x.float(), 0)     # one global factor
    assert fixed.dtype == torch.float32
    assert float((fixed - ref).norm()) < 1e-6 * float((u - ref).norm()) + 1e-6


def test_a_non_quadratic_loss_and_too_many_cells_are_refused():
    b = get_problem("burgers", grid=(16, 16))
    x = b.build_input(b.sample_params(0, range(1)), torch.float64)
    u = b.answer(torch.randn(1, 1, 16, 16, dtype=torch.float64), x)
    with pytest.raises(ValueError, match="not quadratic in the answer.*problem.correction = 0"):
        coarse_correction(b, u, x, 2)
    p = get_problem("poisson", grid=(9, 9))
    x, ref = draws(p, 1)
    with pytest.raises(ValueError, match="use at most 8"):
        coarse_correction(p, ref, x, 9)


def brute(monkeypatch, p, u, x, cells):
    """The correction from one gradient per hat (the colour classes turned off)."""
    from diffnet.problems.contract import correction
    with monkeypatch.context() as mp:
        mp.setattr(correction, "colours_pay", lambda *a: False)
        return coarse_correction(p, u, x, cells)


@pytest.mark.parametrize("options,wide", [({}, False), ({"loss": "residual"}, True)])
def test_colour_classes_give_the_hats_system_or_fall_back(monkeypatch, options, wide):
    """An energy's Hessian reaches a node's neighbours: 2 x 9 coloured gradients give the same
    correction as 2 x 25 (m = 4). A squared residual's reaches two nodes: the coloured system
    is not symmetric, so it falls back to one gradient per field (and remembers it)."""
    from diffnet.problems.contract import correction
    from diffnet.problems.contract.loss_residual import whole_copy

    p = get_problem("poisson", grid=(33, 33), **options)
    x, ref = draws(p, 2)
    _, lift = free_nodes(p, x)
    t = torch.linspace(0, 1, 33, dtype=torch.float64)
    smooth = torch.sin(3 * t)[:, None] * torch.cos(2 * t)[None]     # a shape error, not noise
    u = lift + (ref - lift) * (1 + 0.2 * smooth)
    calls = []
    real = correction.gradient_steps
    monkeypatch.setattr(correction, "gradient_steps", lambda *a: calls.append(len(a[5])) or
                        real(*a))
    fixed = coarse_correction(p, u, x, 4)
    assert (whole_copy(p) in correction.WIDE_HESSIANS) is wide
    assert calls[0] == 18 and (sum(calls) > 18 * 2) is wide
    assert torch.allclose(fixed, brute(monkeypatch, p, u, x, 4), rtol=0, atol=1e-10)
    # fields in passes of 5 (the memory bound at large grids): the same system
    passes = coarse_correction(p, u, x, 4, fields_per_pass=5)
    assert torch.allclose(passes, fixed, rtol=0, atol=1e-12)
    assert float((fixed - ref).norm()) < float((u - ref).norm())


# -- the engine --------------------------------------------------------------------------------
POISSON = variant(TINY, 'problem.name="poisson"', "train.epochs=2", "data.eval_samples=4")


def test_config_refuses_a_correction_with_a_domain_split(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(POISSON)
    assert load_config(str(path), ["problem.correction=4"]).problem.correction == 4
    with pytest.raises(ConfigError) as e:
        load_config(str(path), ["problem.correction=4", "parallel.domain=[1, 2]"])
    assert e.value.key == "problem.correction" and "parallel.domain = []" in str(e.value)


@pytest.fixture(scope="module")
def poisson_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("correction")
    (tmp / "c.toml").write_text(POISSON)
    d = str(tmp / "run")
    p = deepfusion_here(["train", str(tmp / "c.toml"), "--set", f"run.dir={d}",
                         "--set", "problem.correction=4"])
    assert p.returncode == 0, p.stderr[-3000:]
    return d


def test_validation_evaluate_and_the_api_answer_with_the_runs_correction(poisson_run):
    import deepfusion

    d = poisson_run
    out = {}
    for flag in ([], ["--correction", "0"]):
        p = deepfusion_here(["evaluate", d, "--samples", "4", *flag,
                             "--out", os.path.join(d, f"e{len(flag)}.json")])
        assert p.returncode == 0, p.stderr
        with open(os.path.join(d, f"e{len(flag)}.json")) as f:
            out[len(flag)] = json.load(f)
    assert out[0]["correction"] == 4 and out[2]["correction"] == 0
    assert out[0]["rel_l2_mean"] < out[2]["rel_l2_mean"]       # an untrained net: much better
    s = deepfusion.load(d)
    params = s.problem.sample_params(271828, range(4))            # evaluate's draws
    ref = np.stack([s.problem.reference_solution(q) for q in params])
    for m, key in ((None, 0), (0, 2)):
        u = s.predict(params=params, correction=m)
        e = np.linalg.norm((u - ref).reshape(4, -1), axis=1) / np.linalg.norm(
            ref.reshape(4, -1), axis=1)
        assert e.mean() == pytest.approx(out[key]["rel_l2_mean"], rel=1e-4)


def test_infer_answers_with_the_correction_and_records_it(poisson_run, tmp_path):
    import h5py

    out = {}
    for m in ("4", "0"):
        path = str(tmp_path / f"f{m}.h5")
        p = deepfusion_here(["infer", poisson_run, "--samples", "3", "--correction", m,
                             "--out", path])
        assert p.returncode == 0, p.stderr
        with h5py.File(path, "r") as f:
            assert int(f.attrs["correction"]) == int(m)
            out[m] = f["u"][...]
    assert not np.allclose(out["4"], out["0"])


def test_a_correction_that_cannot_work_is_refused_before_any_work(poisson_run, tmp_path):
    """A non-quadratic loss (Burgers) in the config: exit 2 before training, no run
    directory; cells the grid cannot hold on evaluate: exit 2 before the evaluation."""
    (tmp_path / "b.toml").write_text(variant(TINY, "problem.correction=4"))
    d = tmp_path / "run"
    p = deepfusion_here(["train", str(tmp_path / "b.toml"), "--set", f"run.dir={d}"])
    assert p.returncode == 2 and "problem.correction = 4" in p.stderr
    assert "not quadratic" in p.stderr and not d.exists()
    p = deepfusion_here(["evaluate", poisson_run, "--samples", "2", "--correction", "99",
                         "--out", str(tmp_path / "e.json")])
    assert p.returncode == 2 and "use at most 15" in p.stderr
    assert not (tmp_path / "e.json").exists()


def test_infer_refuses_a_correction_with_a_domain_split(poisson_run, tmp_path):
    p = deepfusion_here(["infer", poisson_run, "--samples", "2", "--domain", "1x2",
                         "--out", str(tmp_path / "f.h5")])
    assert p.returncode == 2 and "--correction 0" in p.stderr
