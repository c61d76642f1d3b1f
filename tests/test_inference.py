"""deepfusion infer / solve / compare: file layout, round trips, P=1 vs P=2, bad inputs."""
import json
import os

import h5py
import numpy as np
import pytest
import torch

from deepfusion.engine.checkpoint.store import save_checkpoint
from deepfusion.app.fields_file import read_fields, write_input_fields
from diffnet.generators import build_generator
from diffnet.problems import get_problem
from tests.mpi_util import REAL_MPI, commands, deepfusion

GRID = [16, 16]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """An (untrained) Poisson checkpoint as 'deepfusion train' writes it."""
    torch.manual_seed(0)
    problem = get_problem("poisson", grid=GRID)
    model = build_generator("unet", in_channels=2, depth=2, base_width=4)
    meta = {"step": 0, "config": {"data": {"seed": 0}, "model": {"channels_last": False}},
            "model": {"name": "unet", "kwargs": model.config()},
            "problem": {"name": "poisson", "kwargs": problem.config()}}
    path = tmp_path_factory.mktemp("ck") / "step_00000000.h5"
    save_checkpoint(path, model_state=model.state_dict(), optim_state={}, rng_state={}, meta=meta)
    return str(path)


def test_infer_solve_compare_round_trip(ckpt, tmp_path, cli):
    p, r = str(tmp_path / "p.h5"), str(tmp_path / "r.h5")
    assert cli(["infer", ckpt, "--samples", "5", "--batch", "2", "--out", p])[0] == 0
    assert cli(["solve", "--problem", "poisson", "--grid", "16x16", "--samples", "5",
                "--method", "direct", "--out", r])[0] == 0
    with h5py.File(p) as f:
        assert f["u"].dtype == np.float32 and f["u"].shape == (5, 16, 16)
        assert f["inputs"].shape == (5, 2, 16, 16)
        assert list(f["inputs"].attrs["channels"]) == ["nu", "log_nu"]
        assert f["params"].dtype == np.float64 and f["params"].shape == (5, 4)
        assert [n.decode() for n in f["param_names"][()]] == ["omega_1", "omega_2", "omega_3", "omega_4"]
        assert list(f.attrs["axes"]) == ["y", "x"] and f["coords/x"].shape == (16,)
        assert f.attrs["problem"] == "poisson" and f.attrs["source"] == os.path.abspath(ckpt)
        assert json.loads(f.attrs["problem_kwargs"])["grid"] == GRID
        assert f.attrs["seconds_per_sample"] > 0
        assert f.attrs["warmup"]  # 3 batches on one rank: an untimed warm-up pays
        assert np.all(f["u"][:, :, 0] == 1) and np.all(f["u"][:, :, -1] == 0)  # imposed
    ref = read_fields(r)
    assert ref["source"] == "reference:direct"
    rc, out, _ = cli(["compare", p, r, "--out", str(tmp_path)])
    assert rc == 0 and "worst" in out and "seconds per sample" in out
    assert "network and solver both on 16x16 (native)" in out
    s = json.loads((tmp_path / "compare.json").read_text())
    assert s["pred_work_grid"] == GRID
    assert s["n"] == 5 and len(s["rel_l2"]) == 5 and s["rel_l2_worst"] == max(s["rel_l2"])
    assert s["seconds_per_sample_solver"] > 0 and (tmp_path / "compare.png").stat().st_size > 0


def test_infer_takes_a_run_directory_for_its_newest_checkpoint(ckpt, tmp_path, cli):
    """As evaluate does: RUN_DIR means RUN_DIR/checkpoints' newest complete checkpoint; a
    directory without one is refused by name (not read as an HDF5 file)."""
    import shutil

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copy(ckpt, run_dir / "checkpoints" / "step_00000000.h5")
    p = str(tmp_path / "p.h5")
    rc, out, _ = cli(["infer", str(run_dir), "--samples", "1", "--out", p])
    assert rc == 0 and "no warm-up" in out  # one batch: no untimed second forward
    with h5py.File(p) as f:
        assert f.attrs["source"] == str(run_dir / "checkpoints" / "step_00000000.h5")
        assert not f.attrs["warmup"]
    rc, _, err = cli(["infer", str(tmp_path), "--samples", "1", "--out", p])
    assert rc != 0 and "no complete checkpoint in" in err and "checkpoints" in err


@pytest.mark.full
def test_given_fields_round_trip(ckpt, tmp_path, cli):
    """--inputs with only the diffusivity nu: log_nu is derived; solve from nu (poisson)."""
    problem = get_problem("poisson", grid=GRID)
    nu = problem.build_input(problem.sample_params(7, range(3)))[:, :1].numpy()
    src = str(tmp_path / "nu.h5")
    write_input_fields(src, nu, ["nu"], problem="poisson")
    p, r = str(tmp_path / "p.h5"), str(tmp_path / "r.h5")
    assert cli(["infer", ckpt, "--inputs", src, "--out", p])[0] == 0
    assert cli(["solve", "--problem", "poisson", "--inputs", src, "--out", r])[0] == 0
    a, b = read_fields(p), read_fields(r)
    assert a["params"].shape == (3, 0) and np.allclose(a["inputs"][:, 0], nu[:, 0])
    assert np.allclose(a["inputs"][:, 1], np.log(nu[:, 0]), atol=1e-6)
    assert np.allclose(b["u"][:, :, 0], 1) and np.allclose(b["u"][:, :, -1], 0)
    assert cli(["compare", p, r, "--out", str(tmp_path)])[0] == 0


def test_compare_refuses_different_samples(ckpt, tmp_path, cli):
    p, r = str(tmp_path / "p.h5"), str(tmp_path / "r.h5")
    cli(["infer", ckpt, "--samples", "2", "--out", p])
    cli(["solve", "--problem", "poisson", "--grid", "16x16", "--samples", "2", "--seed", "1",
         "--out", r])
    rc, _, err = cli(["compare", p, r])
    assert rc == 2 and "params differ" in err
    cli(["solve", "--problem", "poisson", "--grid", "32x32", "--samples", "2", "--out", r])
    rc, _, err = cli(["compare", p, r])
    assert rc == 2 and "grids" in err


def test_bad_inputs(ckpt, tmp_path, cli):
    out = str(tmp_path / "p.h5")
    rc, _, err = cli(["infer", str(tmp_path / "nope.h5"), "--samples", "2", "--out", out])
    assert rc == 2 and "checkpoint not found" in err
    bad = tmp_path / "corrupt.h5"
    bad.write_bytes(b"\x89HDF\r\n" + b"garbage" * 50)
    rc, _, err = cli(["infer", str(bad), "--samples", "2", "--out", out])
    assert rc == 2 and "not a valid HDF5" in err
    wrong = str(tmp_path / "u0.h5")
    write_input_fields(wrong, np.ones((2, 1, 16, 16)), ["u0"])
    rc, _, err = cli(["infer", ckpt, "--inputs", wrong, "--out", out])
    assert rc == 2 and "needs ['nu', 'log_nu']" in err
    other = str(tmp_path / "burgers.h5")
    write_input_fields(other, np.ones((2, 2, 16, 16)), ["u0", "t"], problem="burgers")
    rc, _, err = cli(["infer", ckpt, "--inputs", other, "--out", out])
    assert rc == 2 and "made for problem 'burgers'" in err
    rc, _, err = cli(["infer", ckpt, "--samples", "2", "--grid", "18x18", "--work-grid", "as-is",
                      "--out", out])
    assert rc == 2 and "not divisible" in err
    rc, _, err = cli(["infer", ckpt, "--samples", "2", "--out", str(tmp_path / "no" / "p.h5")])
    assert rc == 2 and "does not exist" in err
    rc, _, err = cli(["solve", "--problem", "burgers", "--inputs", other, "--out", out])
    assert rc == 2 and "not available for problem 'burgers'" in err
    assert not os.path.exists(out)


def test_out_of_range_params_warn(ckpt, tmp_path, cli):
    params = tmp_path / "params.csv"
    params.write_text("omega_1,omega_2,omega_3,omega_4\n0,0,0,0\n5,0,0,-1\n")
    out = str(tmp_path / "p.h5")
    rc, _, err = cli(["infer", ckpt, "--params", str(params), "--out", out])
    assert rc == 0 and "WARNING" in err and "omega_1 outside the trained range [-3, 3]" in err
    assert read_fields(out)["params"].tolist() == [[0, 0, 0, 0], [5, 0, 0, -1]]
    params.write_text("1,2,3\n")
    rc, _, err = cli(["infer", ckpt, "--params", str(params), "--out", out])
    assert rc == 2 and "needs 4 values" in err


def test_interrupted_write_leaves_no_file(ckpt, tmp_path, cli, monkeypatch):
    import deepfusion.engine.predict.service as inf

    def boom(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(inf, "run_blocks", boom)
    rc, _, _ = cli(["infer", ckpt, "--samples", "2", "--out", str(tmp_path / "p.h5")])
    assert rc != 0 and os.listdir(tmp_path) == []


@pytest.mark.mpi
def test_p1_and_p2_write_identical_files(ckpt, tmp_path, cli):
    """5 samples in batches of 2 -> 3 batches: rank 0 gets 1, rank 1 gets 2 (uneven rounds).
    The three commands on 2 ranks share a launch."""
    args = ["--samples", "5", "--batch", "2", "--threads", "1"]  # 1 thread: the same bytes
    cmds = (["infer", ckpt], ["infer", ckpt, "--grid", "46x46", "--work-grid", "trained"],
            ["solve", "--problem", "poisson", "--grid", "16x16"])
    two = [str(tmp_path / f"two{i}.h5") for i in range(len(cmds))]
    for code, _, err in commands(2, [c + args + ["--out", p] for c, p in zip(cmds, two)],
                                 env=REAL_MPI):
        assert code == 0, err
    for cmd, p2 in zip(cmds, two):
        p1 = str(tmp_path / "one.h5")
        assert cli(cmd + args + ["--out", p1])[0] == 0
        a, b = read_fields(p1), read_fields(p2)
        assert a["u"].tobytes() == b["u"].tobytes()
        assert a["inputs"].tobytes() == b["inputs"].tobytes()
        assert np.array_equal(a["params"], b["params"]) and b["ranks"] == 2


@pytest.mark.mpi
def test_p2_input_error_exits_2_everywhere(tmp_path):
    res = deepfusion(2, ["infer", str(tmp_path / "nope.h5"), "--samples", "2",
                         "--out", str(tmp_path / "p.h5")], timeout=120, env=REAL_MPI)
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("checkpoint not found") == 1


def test_bf16_inference_close_to_fp32_or_refused(ckpt, tmp_path, cli):
    from deepfusion.engine.parallel.layout import bf16_supported

    p32, p16 = str(tmp_path / "p32.h5"), str(tmp_path / "p16.h5")
    assert cli(["infer", ckpt, "--samples", "3", "--out", p32])[0] == 0
    rc, _, err = cli(["infer", ckpt, "--samples", "3", "--out", p16, "--precision", "bf16"])
    if not bf16_supported():
        assert rc == 2 and "avx512_bf16 or amx_bf16" in err and not os.path.exists(p16)
        return
    assert rc == 0, err
    a, b = read_fields(p32)["u"], read_fields(p16)["u"]
    assert b.dtype == np.float32 and np.all(b[:, :, 0] == 1) and np.all(b[:, :, -1] == 0)
    assert np.abs(a - b).max() < 0.05 * np.abs(a).max()


@pytest.mark.full
def test_work_grid_runs_the_network_on_the_training_grid(ckpt, tmp_path, cli):
    """--work-grid trained on 46x46 (every 3rd node is a 16x16 node, so the resampled inputs
    equal the 16x16 ones; 46 is not even a multiple of 2**depth) = the 16x16 prediction,
    interpolated bilinearly."""
    from diffnet.resample import resample_nodes

    coarse, fine = str(tmp_path / "c.h5"), str(tmp_path / "f.h5")
    assert cli(["infer", ckpt, "--samples", "3", "--out", coarse])[0] == 0
    rc, _, err = cli(["infer", ckpt, "--samples", "3", "--grid", "46x46", "--work-grid",
                      "trained", "--out", fine])
    assert rc == 0 and "note:" not in err
    with h5py.File(coarse) as fc, h5py.File(fine) as ff:
        assert ff["u"].shape == (3, 46, 46) and list(ff.attrs["work_grid"]) == GRID
        want = resample_nodes(torch.from_numpy(fc["u"][:])[:, None], (46, 46))[:, 0].numpy()
        np.testing.assert_allclose(ff["u"][:], want, rtol=0, atol=2e-6)
        np.testing.assert_array_equal(ff["u"][:, :, 0], 1.0)  # Dirichlet values stay exact
        np.testing.assert_array_equal(ff["u"][:, :, -1], 0.0)
    # 40x40 shares no interior nodes with 16x16, so resampled 40x40 inputs would differ from
    # the 16x16 ones: parameter draws are rendered on the work grid instead, as in training
    odd = str(tmp_path / "o.h5")
    assert cli(["infer", ckpt, "--samples", "3", "--grid", "40x40", "--work-grid", "trained",
                "--out", odd])[0] == 0
    with h5py.File(coarse) as fc, h5py.File(odd) as fo:
        want = resample_nodes(torch.from_numpy(fc["u"][:])[:, None], (40, 40))[:, 0].numpy()
        np.testing.assert_allclose(fo["u"][:], want, rtol=0, atol=2e-6)
    # compare names the work grid: the speed-up is a coarse model's plus interpolation
    ref = str(tmp_path / "r.h5")
    assert cli(["solve", "--problem", "poisson", "--grid", "46x46", "--samples", "3",
                "--method", "direct", "--out", ref])[0] == 0
    rc, out, _ = cli(["compare", fine, ref, "--out", str(tmp_path)])
    assert rc == 0 and "ran on a 16x16 work grid, interpolated to 46x46" in out
    assert json.loads((tmp_path / "compare.json").read_text())["pred_work_grid"] == GRID
    # without --work-grid: the training grid (the default), with a note saying so
    rc, _, err = cli(["infer", ckpt, "--samples", "1", "--grid", "48x48",
                      "--out", str(tmp_path / "n.h5")])
    assert rc == 0 and "trained on 16x16" in err and "--work-grid trained" in err


@pytest.mark.parametrize("value, message", [
    ("foo", "--work-grid must be HxW"),
    ("18x18", "--work-grid 18x18: grid 18x18 is not divisible by 2**depth = 4"),
])
def test_bad_work_grid(ckpt, tmp_path, cli, value, message):
    rc, _, err = cli(["infer", ckpt, "--samples", "1", "--grid", "32x32", "--work-grid", value,
                      "--out", str(tmp_path / "x.h5")])
    assert rc == 2 and message in err and not os.path.exists(tmp_path / "x.h5")


def test_inputs_on_a_grid_the_network_cannot_take_exit_2_up_front(ckpt, tmp_path, cli):
    """33x31 fields for a depth-2 network (multiples of 4) run as is: every rank stops at the
    input check with exit 2 and one line naming the grid and the fix, not a traceback (exit 1)."""
    problem = get_problem("poisson", grid=(33, 31))
    nu = problem.build_input(problem.sample_params(0, range(2)))[:, :1].numpy()
    src, out = str(tmp_path / "nu.h5"), tmp_path / "p.h5"
    write_input_fields(src, nu, ["nu"])
    res = deepfusion(0, ["infer", ckpt, "--inputs", src, "--work-grid", "as-is",
                         "--out", str(out)], timeout=120)
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert "33x31" in lines[0] and "not divisible" in lines[0] and "--work-grid trained" in lines[0]
    assert "Traceback" not in res.stderr and not out.exists()
    # the fix the message names: run the network on its training grid, interpolate back
    rc, _, err = cli(["infer", ckpt, "--inputs", src, "--work-grid", "trained",
                      "--out", str(out)])
    assert rc == 0, err
    with h5py.File(out) as f:
        assert f["u"].shape == (2, 33, 31) and list(f.attrs["work_grid"]) == GRID


def test_the_error_panel_is_centred_on_zero():
    """compare's / evaluate's error column: symmetric colour limits, whatever the sign of the
    largest error (matplotlib's own [min, max] put white at -0.4 for a field of ~0 with one
    -0.9 line, and the 1024² Burgers figure showed a whole row red)."""
    from deepfusion.engine.predict.plots import error_style

    s = error_style(np.array([[0.0, 0.01], [-0.9, 0.0]]))
    assert (s["vmin"], s["vmax"], s["cmap"]) == (-0.9, 0.9, "RdBu_r")
    assert error_style(np.zeros((2, 2)))["vmax"] == 1.0   # an exact answer still gets limits
