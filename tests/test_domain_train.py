"""Domain parallelism end to end (``parallel.domain``): real mpiexec runs, float64, tiny grids.

The split is exact, so a run split over ranks logs the losses of the undivided run (rtol 1e-9:
only the order of the sums differs), its held-out error is the same, and its checkpoints do
not depend on the split.
"""
import json
import os

import pytest

from tests.in_process import deepfusion_here
from tests.mpi_util import commands, deepfusion
from tests.test_engine_mpi import train
from tests.tiny_configs import TINY as ENGINE_TINY, variant

pytestmark = pytest.mark.mpi

# The engine tests' tiny Burgers run, with the initial and inflow values imposed.
TINY = variant(ENGINE_TINY, "problem.options={hard_bc = true}")


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    return str(path)


def records(run_dir, kind):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def losses(run_dir):
    return [r["loss"] for r in records(run_dir, "step")]


def same(a, b, rel=1e-9):
    assert len(a) == len(b) and len(a) > 0, (a, b)
    for x, y in zip(a, b):
        assert x == pytest.approx(y, rel=rel), (a, b)


@pytest.fixture(scope="module")
def undivided(tmp_path_factory):
    """The reference: the tiny run on one process, no split."""
    d = tmp_path_factory.mktemp("undivided")
    cfg = d / "tiny.toml"
    cfg.write_text(TINY)
    p = train(None, str(cfg), str(d / "run"))
    assert p.returncode == 0, p.stderr
    return str(d / "run")


# [2, 1] alone is covered op by op (test_split_unet_mpi, test_split_loss_mpi) and in the
# multigrid case below; the suite's time budget keeps one training run per other split here.
@pytest.mark.parametrize("n,domain", [(2, "[1, 2]"), pytest.param(4, "[2, 2]", marks=pytest.mark.full),
                                      pytest.param(4, "[1, 2]", marks=pytest.mark.full)])
def test_split_run_logs_the_undivided_losses(undivided, tiny, tmp_path, n, domain):
    d = str(tmp_path / "split")
    p = train(n, tiny, d, f"parallel.domain={domain}")
    assert p.returncode == 0, p.stderr
    assert "domain split" in p.stdout
    same(losses(d), losses(undivided))
    assert len(losses(d)) == 20
    ev, ref = (json.load(open(os.path.join(r, "eval.json"))) for r in (d, undivided))
    same(ev["rel_l2"], ref["rel_l2"], rel=1e-7)


def test_checkpoint_of_a_split_resumes_under_another_split(undivided, tiny, tmp_path):
    d = str(tmp_path / "r")
    p = train(2, tiny, d, "parallel.domain=[1, 2]", "train.checkpoint_every=4",
              "train.max_steps=8")
    assert p.returncode == 0, p.stderr
    p = deepfusion(2, ["train", "--resume", d, "--set", "parallel.domain=[2, 1]",
                       "--set", "train.max_steps=14"])
    assert p.returncode == 0, p.stderr
    p = deepfusion_here(["train", "--resume", d, "--set", "parallel.domain=[]",
                         "--set", "train.max_steps=0"])
    assert p.returncode == 0, p.stderr
    same(losses(d), losses(undivided))


REFUSED = [
    (2, ["parallel.domain=[1, 2, 2]"], ["parallel.domain", "one block count per axis"]),
    (3, ["parallel.domain=[1, 2]"], ["not a multiple of 2", "ranks"]),
    (2, ["parallel.domain=[1, 2]", "problem.grid=[16, 20]"], ["cannot be split", "20"]),
    (2, ["parallel.domain=[1, 2]", "train.compile=true"], ["train.compile", "parallel.domain"]),
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """``train`` of each split that cannot work, the commands on the same number of ranks in
    one launch (each is refused before training): {case: (run dir, exit code, stderr)}."""
    home = tmp_path_factory.mktemp("refused")
    cfg = home / "tiny.toml"
    cfg.write_text(TINY)
    out = {}
    for n in sorted({n for n, _, _ in REFUSED}):
        cases = [i for i, case in enumerate(REFUSED) if case[0] == n]
        argvs = [["train", str(cfg), "--set", f"run.dir={home / str(i)}"]
                 + [a for s in REFUSED[i][1] for a in ("--set", s)] for i in cases]
        for i, (rc, _, err) in zip(cases, commands(n, argvs)):
            out[i] = (str(home / str(i)), rc, err)
    return out


@pytest.mark.parametrize("case", range(len(REFUSED)),
                         ids=[f"{n}-sets{i}-words{i}" for i, (n, _, _) in enumerate(REFUSED)])
def test_a_split_that_cannot_work_is_refused_before_training(refused, case):
    d, rc, err = refused[case]
    assert rc == 2, err
    for w in REFUSED[case][2]:
        assert w in err, (w, err)
    assert not os.path.exists(os.path.join(d, "metrics.jsonl"))


def latest_checkpoint(run_dir):
    import glob

    return sorted(glob.glob(os.path.join(run_dir, "checkpoints", "step_*.h5")))[-1]


def infer(ranks, run_dir, out, *args):
    """``deepfusion infer`` of ``run_dir``'s newest checkpoint on ``ranks`` processes (0: the
    undivided reference, in this process)."""
    args = ["infer", latest_checkpoint(run_dir), "--out", str(out), "--threads", "1", *args]
    return deepfusion(ranks, args) if ranks else deepfusion_here(args)


@pytest.mark.parametrize("n,domain", [(4, "2x2")])
@pytest.mark.full
def test_infer_split_over_ranks_writes_the_undivided_prediction(undivided, tmp_path, n, domain):
    import h5py
    import numpy as np

    outs = {}
    for ranks, extra in ((0, []), (n, ["--domain", domain])):
        out = str(tmp_path / f"p{ranks}.h5")
        p = infer(ranks, undivided, out, "--samples", "3", "--batch", "2", *extra)
        assert p.returncode == 0, p.stderr
        assert "MiB on the largest rank" in p.stdout
        with h5py.File(out) as f:
            outs[ranks] = f["u"][...]
            peaks = f.attrs["peak_rss_mib_per_rank"]
        # one high-water mark per rank, in MiB (a torch process holds > 50 MiB, < 100 GiB here)
        assert len(peaks) == max(ranks, 1) and all(50 < m < 1e5 for m in peaks), peaks
    np.testing.assert_allclose(outs[n], outs[0], rtol=1e-6, atol=1e-7)


def test_infer_split_in_bf16_matches_the_fp32_prediction_to_bf16_rounding(undivided, tmp_path):
    """--precision bf16 under a split: the halo moves bf16 bits exactly, the norm statistics
    are all-reduced in float32 (MPI cannot add bf16); refused where the CPU has no bf16."""
    import h5py
    import numpy as np

    from deepfusion.engine.parallel.layout import bf16_supported

    outs = {}
    for ranks, extra in ((0, []), (2, ["--domain", "1x2", "--precision", "bf16"])):
        out = str(tmp_path / f"p{ranks}.h5")
        p = infer(ranks, undivided, out, "--samples", "2", *extra)
        if ranks and not bf16_supported():
            assert p.returncode == 2 and "bf16" in p.stderr, p.stderr
            return
        assert p.returncode == 0, p.stderr
        with h5py.File(out) as f:
            outs[ranks] = f["u"][...]
    err = np.linalg.norm(outs[2] - outs[0]) / np.linalg.norm(outs[0])
    assert 0 < err < 0.03, err  # bf16 keeps ~3 digits per layer; a wrong exchange is O(1)


def test_infer_refuses_a_domain_the_grid_cannot_take(undivided, tmp_path):
    p = infer(2, undivided, tmp_path / "x.h5", "--samples", "1", "--domain", "1x2",
              "--grid", "16x20", "--work-grid", "as-is")
    assert p.returncode == 2, p.stderr
    assert "cannot be split" in p.stderr


MULTIGRID = variant(TINY, "train.levels=[{grid = [8, 8], steps = 6}, {grid = [16, 16], steps = 6}]")


@pytest.mark.parametrize("name,n,domain", [("3d", 2, "[1, 1, 2]"), ("multigrid", 2, "[2, 1]")])
@pytest.mark.full
def test_3d_and_multigrid_splits_log_the_undivided_losses(tmp_path, name, n, domain):
    """A 3-D split (blocks of 8x8x4 nodes), and a schedule whose levels change the grid and so
    every rank's block."""
    from tests.mpi_util import REAL_MPI
    from tests.test_3d import TINY3

    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY3 if name == "3d" else MULTIGRID)
    env = REAL_MPI if name == "3d" else None
    ref, d = str(tmp_path / "ref"), str(tmp_path / "split")
    assert train(None, str(cfg), ref).returncode == 0
    p = train(n, str(cfg), d, f"parallel.domain={domain}", env=env)
    assert p.returncode == 0, p.stderr
    assert "domain split" in p.stdout
    same(losses(d), losses(ref))
    if name == "multigrid":
        assert {tuple(r["grid"]) for r in records(d, "step")} == {(8, 8), (16, 16)}
