"""``deepfusion.load``: a checkpoint or a run directory as a solver in Python, giving the numbers
``deepfusion infer`` writes (same pipeline, same batches; bitwise at --threads 1), numpy or torch
in and out, parameter draws, 3-D, the work-grid default, and errors that name the fix."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import deepfusion
from deepfusion.app.fields_file import read_fields, write_input_fields
from deepfusion.engine.checkpoint.store import save_checkpoint
from diffnet.generators import build_generator
from diffnet.problems import get_problem
from tests.in_process import deepfusion_here
from tests.mpi_util import ROOT


def make_checkpoint(path, problem_name, grid, model_name="unet", **model_kw):
    """An untrained checkpoint as 'deepfusion train' writes it (no training: fast)."""
    torch.manual_seed(0)
    problem = get_problem(problem_name, grid=grid)
    model = build_generator(model_name, in_channels=len(problem.input_channels), **model_kw)
    meta = {"step": 0, "config": {"data": {"seed": 0}, "model": {"channels_last": False}},
            "model": {"name": model_name, "kwargs": model.config()},
            "problem": {"name": problem_name, "kwargs": problem.config()}}
    save_checkpoint(path, model_state=model.state_dict(), optim_state={}, rng_state={}, meta=meta)
    return str(path)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory holding one Poisson 16x16 checkpoint."""
    d = tmp_path_factory.mktemp("api") / "run"
    (d / "checkpoints").mkdir(parents=True)
    make_checkpoint(d / "checkpoints" / "step_00000000.h5", "poisson", [16, 16], depth=2,
                    base_width=4)
    return str(d)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """Two real training steps of configs/demo.toml at 16x16 (channels_last, as trained)."""
    d = str(tmp_path_factory.mktemp("demo") / "run")
    p = deepfusion_here(["train", os.path.join(ROOT, "configs/demo.toml"), "--set",
                         f"run.dir={d}", "--set", "problem.grid=[16,16]", "--set",
                         "model.options={depth=2,base_width=4}", "--set", "train.max_steps=2",
                         "--set", "data.eval_samples=0", "--set", "run.plots=false",
                         "--set", "parallel.threads_per_rank=1"])
    assert p.returncode == 0, p.stderr
    return d


def test_import_is_light_and_load_describes_the_solver(run_dir):
    p = subprocess.run([sys.executable, "-c", "import sys, deepfusion; "
                        "print('torch' in sys.modules, callable(deepfusion.load))"],
                       capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.stdout.split() == ["False", "True"], p.stderr
    s = deepfusion.load(run_dir)
    assert isinstance(s, deepfusion.Solver)
    assert s.grid == (16, 16) and s.channels == ("nu", "log_nu") and s.problem.name == "poisson"
    assert s.param_names == ("omega_1", "omega_2", "omega_3", "omega_4") and s.step == 0
    assert s.path.endswith("step_00000000.h5") and s.dtype == torch.float32
    assert "'poisson' on 16x16" in repr(s) and "['nu', 'log_nu']" in repr(s)
    assert s.param_bounds.shape == (4, 2)


def test_equals_infer_for_draws_fields_and_another_grid(run_dir, tmp_path, cli):
    """The file of `deepfusion infer --threads 1` and predict at threads=1: identical bytes,
    for parameter draws, for given fields (numpy and torch) and on a grid the network was not
    trained on (the default: its training grid, interpolated)."""
    s = deepfusion.load(run_dir, threads=1)
    params = s.sample(5, seed=7)
    for grid, extra in ((None, []), ((46, 46), ["--grid", "46x46"])):
        out = str(tmp_path / "p.h5")
        rc, _, err = cli(["infer", run_dir, "--samples", "5", "--seed", "7", "--batch", "2",
                          "--threads", "1", "--out", out, *extra])
        assert rc == 0, err
        f = read_fields(out)
        assert np.array_equal(f["params"], params)
        u = s.predict(params=params, grid=grid, batch=2)
        assert u.dtype == np.float32 and u.tobytes() == f["u"].tobytes()
    fields = s.inputs(params)                       # (5, 2, 16, 16) float64: nu, log nu
    src, out = str(tmp_path / "x.h5"), str(tmp_path / "q.h5")
    write_input_fields(src, fields, ["nu", "log_nu"])
    assert cli(["infer", run_dir, "--inputs", src, "--threads", "1", "--out", out])[0] == 0
    want = read_fields(out)["u"]
    assert s.predict(fields).tobytes() == want.tobytes()
    got = s.predict(torch.from_numpy(fields))
    assert isinstance(got, torch.Tensor) and got.numpy().tobytes() == want.tobytes()
    assert s.predict({"nu": fields[:, 0]}).tobytes() == want.tobytes()   # log_nu derived


def test_checkpoint_file_work_grid_and_module(run_dir):
    """A checkpoint file loads too; the network runs as is only when asked (with a warning
    saying what it costs); the differentiable module is the answer on the training grid."""
    ckpt = os.path.join(run_dir, "checkpoints", "step_00000000.h5")
    s = deepfusion.load(ckpt)
    p = s.sample(2, seed=1)
    fine = s.predict(params=p, grid=(32, 32))
    coarse = torch.from_numpy(s.predict(params=p))[:, None]
    from diffnet.resample import resample_nodes

    # 32 is not a node-aligned refinement of 16: the draws are rendered on 16x16 (as in
    # training) and the answer interpolated, so it is the 16x16 answer resampled
    np.testing.assert_allclose(fine, resample_nodes(coarse, (32, 32))[:, 0].numpy(), atol=2e-6)
    with pytest.warns(UserWarning, match="receptive field"):
        as_is = s.predict(params=p, grid=(32, 32), work_grid="as-is")
    assert as_is.shape == (2, 32, 32) and not np.allclose(as_is, fine)
    x = torch.from_numpy(s.inputs(p)).float().requires_grad_(True)
    u = s.module(x)
    u.pow(2).sum().backward()
    assert u.shape == (2, 1, 16, 16) and x.grad is not None and x.grad.abs().sum() > 0
    assert torch.equal(u.detach()[:, 0], torch.from_numpy(s.predict(params=p)))


def test_real_run_with_channels_last_and_dtype(demo_run):
    s = deepfusion.load(demo_run, threads=1)
    assert s.problem.name == "burgers" and s.channels_last and s.step == 2
    u = s.predict(params=s.sample(3, seed=2))
    assert u.shape == (3, 16, 16) and np.all(np.isfinite(u))
    d = deepfusion.load(demo_run, dtype="float64", threads=1)
    u64 = d.predict(params=s.sample(3, seed=2))
    assert u64.dtype == np.float64 and np.allclose(u64, u, atol=1e-4)


def test_a_3d_problem(tmp_path, cli):
    ckpt = make_checkpoint(tmp_path / "step_00000000.h5", "poisson3d", [8, 8, 8], "unet3d",
                           depth=1, base_width=2, max_width=4)
    s = deepfusion.load(ckpt, threads=1)
    assert s.grid == (8, 8, 8)
    out = str(tmp_path / "p.h5")
    assert cli(["infer", ckpt, "--samples", "3", "--threads", "1", "--out", out])[0] == 0
    u = s.predict(params=s.sample(3))
    assert u.shape == (3, 8, 8, 8) and u.tobytes() == read_fields(out)["u"].tobytes()


def test_errors_name_what_is_wrong_and_the_fix(run_dir, tmp_path):
    s = deepfusion.load(run_dir)
    x = s.inputs(s.sample(2))
    bad = x.copy()
    bad[0, 0, 3, 3] = np.nan
    cases = [
        (lambda: s.predict(x[:, :1]), "takes 2, ['nu', 'log_nu'] in this order"),
        (lambda: s.predict(x[:, :, None]), "has 2 grid axes: give fields of shape (N, C, H, W)"),
        (lambda: s.predict(bad), "must be finite everywhere"),
        (lambda: s.predict(x, params=s.sample(2)), "exactly one of inputs"),
        (lambda: s.predict(params=np.zeros((2, 3))), "needs 4 values"),
        (lambda: s.predict(params=s.sample(1), grid=(18, 18), work_grid="as-is"),
         "not divisible"),
        (lambda: s.predict(params=s.sample(1), grid=(8, 8, 8)), "has 3 axes"),
        (lambda: deepfusion.load(run_dir, dtype="float16"), "dtype must be one of"),
        (lambda: deepfusion.load(run_dir, work_grid="fine"), "must be HxW"),
        (lambda: s.sample(0), "positive integer"),
    ]
    for call, says in cases:
        with pytest.raises(ValueError, match=None) as e:
            call()
        assert says in str(e.value), (says, str(e.value))
    junk = tmp_path / "junk.h5"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a valid HDF5"):
        deepfusion.load(str(junk))
    empty = tmp_path / "empty_run"
    (empty / "checkpoints").mkdir(parents=True)
    with pytest.raises(ValueError, match="no complete checkpoint"):
        deepfusion.load(str(empty))
    shutil.rmtree(empty)


def test_infer_work_grid_default_and_the_as_is_spelling(run_dir, tmp_path, cli):
    """No silent resolution change: another grid runs the network on its training grid by
    default and says so; 'as-is' (or the old 'none') runs it on the asked grid and says what
    that costs; at the training grid nothing is said and nothing changes."""
    outs = {}
    for flag in ([], ["--work-grid", "trained"], ["--work-grid", "as-is"],
                 ["--work-grid", "none"]):
        out = str(tmp_path / f"p{len(outs)}.h5")
        rc, _, err = cli(["infer", run_dir, "--samples", "2", "--grid", "32x32", "--threads", "1",
                          "--out", out, *flag])
        assert rc == 0, err
        outs[tuple(flag)] = (read_fields(out), err)
    default, err = outs[()]
    assert default["work_grid"] == [16, 16] and "interpolated to 32x32" in err
    assert "the default" in err and "--work-grid as-is" in err
    trained, err = outs[("--work-grid", "trained")]
    assert "note: the network" not in err and trained["u"].tobytes() == default["u"].tobytes()
    for spelling in ("as-is", "none"):
        f, err = outs[("--work-grid", spelling)]
        assert f["work_grid"] == [32, 32] and "receptive field" in err
    assert outs[("--work-grid", "none")][0]["u"].tobytes() == \
        outs[("--work-grid", "as-is")][0]["u"].tobytes()
    rc, _, err = cli(["infer", run_dir, "--samples", "2", "--out", str(tmp_path / "t.h5")])
    assert rc == 0 and "note: the network" not in err
