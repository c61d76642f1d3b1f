"""3-D problems through deepfusion (#16): train, resume, evaluate, infer, solve, compare, the
fields files and their XDMF sidecars, channels_last_3d, a prolonged multigrid schedule.

Real ``mpiexec -n 2`` jobs on a tiny 8^3 grid (unet3d depth 1, widths 2..4, float64), so the
whole file stays short on 2 cores. Timeouts are hang guards, never speed assertions.
"""
import json
import os
import xml.etree.ElementTree as ET

import h5py
import numpy as np
import pytest
import torch

from deepfusion.app.fields_file import read_fields, write_input_fields
from tests.faults.steps import fault_env
from tests.mpi_util import REAL_MPI, deepfusion
from tests.test_engine_mpi import losses, train
from tests.tiny_configs import TINY, variant

TINY3 = variant(TINY, 'problem.name="poisson3d"', "problem.grid=[8, 8, 8]",
                'model.name="unet3d"', "model.options={depth = 1, base_width = 2, max_width = 4}",
                "model.channels_last=true", "data.n_samples=8", "train.epochs=3", "train.log_every=2",
                "train.checkpoint_every=2", drop=("train.checksum_every",))
# 8^3 -> 16^3, the second level's network one level deeper (prolong)
MULTIGRID = variant(TINY3, "problem.grid=[16, 16, 16]",
                    "model.prolong={depth = 1, base_width = 2, max_width = 4}",
                    "train.levels=[{grid = [8, 8, 8], steps = 2}, "
                    "{grid = [16, 16, 16], steps = 2, prolong = true}]")


def write(tmp_path, name, text) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def run3d(tmp_path_factory):
    """The tiny 3-D config trained on 2 ranks: (config path, run dir)."""
    tmp = tmp_path_factory.mktemp("run3d")
    config = write(tmp, "tiny3.toml", TINY3)
    d = str(tmp / "p2")
    p = train(2, config, d, "run.plots=true", env=REAL_MPI)  # the report, checked below; ~3 s
    assert p.returncode == 0, p.stderr
    return config, d


def newest_checkpoint(run_dir) -> str:
    d = os.path.join(run_dir, "checkpoints")
    return os.path.join(d, sorted(os.listdir(d))[-1])


@pytest.mark.mpi
def test_same_losses_on_one_and_two_ranks_in_either_layout(run3d, tmp_path):
    """P = 2 in channels_last_3d (the fixture) and P = 1 (in this process) in NCDHW log the
    same 6 losses (float64: the first, before any update, to rtol 1e-12, since the layout
    changes the memory order, never the function; all to rtol 1e-9), the loss falls, and the
    run writes its report (eval.png: three orthogonal slices per sample). The checkpoint holds
    the 5-D weights as channels_last_3d."""
    from deepfusion.engine.checkpoint.store import load_checkpoint

    config, d2 = run3d
    d1 = str(tmp_path / "p1")
    p = train(None, config, d1, "model.channels_last=false", "data.eval_samples=0")
    assert p.returncode == 0, p.stderr
    a, b = losses(d1), losses(d2)
    assert len(a) == len(b) == 6
    assert a[0] == pytest.approx(b[0], rel=1e-12)
    assert a == pytest.approx(b, rel=1e-9) and a[-1] < a[0]
    for name in ("loss.png", "eval.json", "eval.png"):
        assert os.path.getsize(os.path.join(d2, name)) > 0, name
    recs = [json.loads(line) for line in open(os.path.join(d2, "metrics.jsonl"))]
    assert {tuple(r["grid"]) for r in recs if r["kind"] == "step"} == {(8, 8, 8)}
    assert_channels_last_3d(load_checkpoint(newest_checkpoint(d2))["model_state"].values())


@pytest.mark.mpi
@pytest.mark.full
def test_resume_after_a_failure_continues_the_same_trajectory(run3d, tmp_path):
    """Rank 1 fails during step 6; the resume from the step-4 checkpoint gives the uninterrupted
    run's losses bit for bit (the inputs the resumed run rebuilds are the same bits)."""
    config, full = run3d
    cut = str(tmp_path / "cut")
    p = train(2, config, cut, "data.eval_samples=0", env={**REAL_MPI, **fault_env("raise@6:1")})
    assert p.returncode != 0 and "injected failure at step 6 on rank 1" in p.stderr
    p = deepfusion(2, ["train", "--resume", cut], env=REAL_MPI)
    assert p.returncode == 0, p.stderr
    assert "step_00000004" in p.stdout
    assert losses(cut) == losses(full)


def assert_channels_last_3d(tensors):
    """Every 5-D tensor is channels_last_3d, and some are not also plain contiguous (where
    the two coincide, e.g. 1x1x1 kernels, the test cannot tell them apart)."""
    five = [t for t in tensors if t.dim() == 5]
    assert five and all(t.is_contiguous(memory_format=torch.channels_last_3d) for t in five)
    assert any(not t.is_contiguous() for t in five)


def test_channels_last_3d_weights_and_gradient_buckets(tmp_path):
    """build_model converts a 3-D generator to channels_last_3d; the gradient buckets keep
    those strides (dense views), so autograd accumulates in place."""
    from deepfusion.app.build import build_model, build_problem
    from deepfusion.config import load_config
    from deepfusion.engine.parallel.comm import SerialComm
    from deepfusion.engine.parallel.gradsync import GradSync
    from deepfusion.engine.parallel.memformat import as_format, memory_format

    cfg = load_config(write(tmp_path, "c.toml", TINY3), [])
    task = build_problem(cfg)
    model, _ = build_model(cfg, task)
    assert_channels_last_3d(list(model.parameters()))
    gs = GradSync(model, SerialComm())
    assert all(p.grad.stride() == p.stride() for p in model.parameters())
    x = as_format(task.build_input(task.sample_params(0, range(2)), dtype=torch.float64))
    assert x.is_contiguous(memory_format=torch.channels_last_3d)
    task.loss_terms(task.impose(model(x), x), x)["pde"].sum().backward()
    gs.check_views()
    assert sum(float(b.abs().sum()) for b in gs.flat_grads()) > 0
    assert memory_format(4) == torch.channels_last and memory_format(5, False) == \
        torch.contiguous_format


@pytest.mark.mpi
def test_evaluate_infer_solve_compare_on_the_checkpoint(run3d, tmp_path, cli):
    """On the trained 3-D checkpoint: evaluate (test draw), infer on 2 ranks (a fields file
    (N, D, H, W) with its XDMF sidecar), solve and compare (same samples; compare.png)."""
    _, d2 = run3d
    ckpt = newest_checkpoint(d2)
    p, r = str(tmp_path / "p.h5"), str(tmp_path / "r.h5")
    res = deepfusion(2, ["infer", ckpt, "--samples", "3", "--batch", "1", "--out", p],
                     env=REAL_MPI)
    assert res.returncode == 0, res.stderr
    assert "8x8x8" in res.stdout and "p.xmf" in res.stdout
    rc, out, err = cli(["evaluate", ckpt, "--samples", "2"])
    assert rc == 0, err
    ev = json.loads(open(os.path.join(d2, "eval_seed271828.json")).read())
    assert ev["n"] == 2 and len(ev["rel_l2"]) == 2 and 0 < ev["rel_l2_mean"] < 10
    rc, _, err = cli(["solve", "--problem", "poisson3d", "--grid", "8x8x8", "--samples", "3",
                      "--out", r])
    assert rc == 0, err
    a, b = read_fields(p), read_fields(r)
    assert a["u"].shape == b["u"].shape == (3, 8, 8, 8)
    assert a["inputs"].shape == (3, 2, 8, 8, 8) and a["axes"] == ["z", "y", "x"]
    assert np.all(a["u"][..., 0] == 1) and np.all(a["u"][..., -1] == 0)  # Dirichlet x-faces
    assert np.array_equal(a["params"], b["params"]) and a["ranks"] == 2
    check_xdmf(p, n=3, grid=(8, 8, 8), channels=["nu", "log_nu"])
    rc, out, err = cli(["compare", p, r, "--out", str(tmp_path)])
    assert rc == 0, err
    s = json.loads((tmp_path / "compare.json").read_text())
    assert s["grid"] == [8, 8, 8] and s["n"] == 3 and len(s["rel_l2"]) == 3
    assert s["rel_l2_worst"] == max(s["rel_l2"]) and (tmp_path / "compare.png").stat().st_size


def check_xdmf(h5_path, *, n, grid, channels):
    """The sidecar is well-formed XDMF: one grid per sample on a 3DCoRectMesh of ``grid``,
    attributes u and the channels, hyperslabs naming the HDF5 file and its datasets."""
    xmf = os.path.splitext(h5_path)[0] + ".xmf"
    root = ET.parse(xmf).getroot()  # raises on malformed XML
    assert root.tag == "Xdmf"
    grids = root.findall("./Domain/Grid/Grid")
    assert len(grids) == n
    mesh = [1] * (3 - len(grid)) + list(grid)
    name = os.path.basename(h5_path)
    with h5py.File(h5_path) as f:
        for g in grids:
            topo = g.find("Topology")
            assert topo.get("TopologyType") == "3DCoRectMesh"
            assert [int(v) for v in topo.get("Dimensions").split()] == mesh
            assert g.find("Geometry").get("GeometryType") == "ORIGIN_DXDYDZ"
            attrs = {a.get("Name"): a for a in g.findall("Attribute")}
            assert list(attrs) == ["u", *channels]
            for a in attrs.values():
                heavy = a.find("DataItem/DataItem[@Format='HDF']").text
                file, dataset = heavy.split(":")
                assert file == name and dataset.lstrip("/") in f
                dims = [int(v) for v in a.find("DataItem/DataItem[@Format='HDF']")
                        .get("Dimensions").split()]
                assert dims == list(f[dataset.lstrip("/")].shape)


@pytest.mark.mpi
def test_given_3d_fields_and_bad_grids(run3d, tmp_path, cli):
    """--inputs with nu alone on the 3-D grid; a 2-axis --grid or 2-D fields for a 3-D
    network are refused naming what to give."""
    from diffnet.problems import get_problem

    ckpt = newest_checkpoint(run3d[1])
    problem = get_problem("poisson3d", grid=(8, 8, 8))
    nu = problem.build_input(problem.sample_params(3, range(2)))[:, :1].numpy()
    src, out = str(tmp_path / "nu.h5"), str(tmp_path / "p.h5")
    write_input_fields(src, nu, ["nu"])
    rc, _, err = cli(["infer", ckpt, "--inputs", src, "--out", out])
    assert rc == 0, err
    a = read_fields(out)
    assert a["u"].shape == (2, 8, 8, 8) and np.allclose(a["inputs"][:, 1], np.log(nu[:, 0]),
                                                        atol=1e-6)
    rc, _, err = cli(["infer", ckpt, "--samples", "1", "--grid", "8x8", "--out", out])
    assert rc == 2 and "--grid 8x8 has 2 axes" in err and "DxHxW" in err
    rc, _, err = cli(["infer", ckpt, "--samples", "1", "--grid", "8x8x8x8", "--out", out])
    assert rc == 2 and "DxHxW" in err
    flat = str(tmp_path / "flat.h5")
    write_input_fields(flat, np.ones((2, 1, 8, 8)), ["nu"])
    rc, _, err = cli(["infer", ckpt, "--inputs", flat, "--out", out])
    assert rc == 2 and "3 grid axes" in err and "(N, C, D, H, W)" in err


@pytest.mark.mpi
@pytest.mark.full
def test_prolonged_multigrid_schedule_8_to_16(tmp_path, cli):
    """A tiny 8^3 -> 16^3 schedule with prolong on 2 ranks: both levels train, the network
    grows (a 3-D correction U-Net), and infer runs the grown network on 16^3 and its inner
    network on 8^3."""
    config = write(tmp_path, "mg.toml", MULTIGRID)
    d = str(tmp_path / "mg")
    p = train(2, config, d, env=REAL_MPI)
    assert p.returncode == 0, p.stderr
    recs = [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))]
    steps = [r for r in recs if r["kind"] == "step"]
    assert [tuple(r["grid"]) for r in steps] == [(8, 8, 8)] * 2 + [(16, 16, 16)] * 2
    assert all(np.isfinite(r["loss"]) for r in steps)
    ckpt = newest_checkpoint(d)
    for grid in ("16x16x16", "8x8x8"):
        out = str(tmp_path / f"p{grid}.h5")
        rc, _, err = cli(["infer", ckpt, "--samples", "2", "--grid", grid, "--out", out])
        assert rc == 0, err
        shape = tuple(int(v) for v in grid.split("x"))
        assert read_fields(out)["u"].shape == (2, *shape)
        check_xdmf(out, n=2, grid=shape, channels=["nu", "log_nu"])


def test_metrics_and_figure_views_know_the_dimension():
    """relative_l2 / max_error: one 3-D field with dims=3, batches as before; plots.views
    shows a 3-D field as its three mid-slices and a 2-D field whole."""
    from deepfusion.engine.predict.plots import view_geometry, views
    from diffnet.metrics import max_error, relative_l2

    rng = np.random.default_rng(0)
    a, b = rng.random((3, 4, 5, 6)), rng.random((3, 4, 5, 6))
    batch = relative_l2(a, b)
    assert batch.shape == (3,) and relative_l2(a[1], b[1], dims=3) == pytest.approx(batch[1])
    assert max_error(a[2], b[2], dims=3) == pytest.approx(max_error(a, b, dims=3)[2])
    assert isinstance(relative_l2(a[0, 0], b[0, 0]), float)  # a single 2-D field, as before
    with pytest.raises(ValueError, match="dims = 3"):
        relative_l2(a[0, 0], b[0, 0], dims=3)
    v = views(a[0])
    assert [x.shape for x in v] == [(5, 6), (4, 6), (4, 5)]
    assert np.array_equal(v[0], a[0, 2]) and np.array_equal(v[2], a[0, :, :, 3])
    geo = view_geometry(["z", "y", "x"], [(0, 1), (0, 2), (0, 3)], (4, 5, 6))
    assert [(g["xlabel"], g["ylabel"]) for g in geo] == [("x", "y"), ("x", "z"), ("y", "z")]
    assert geo[1]["extent"] == (0, 3, 0, 1) and geo[0]["cut"] == "z = 0.667"
    assert len(views(a[0, 0])) == 1
