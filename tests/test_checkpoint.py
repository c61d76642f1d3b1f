"""Atomic HDF5 checkpoints: bit-exact round trips of model, optimiser and RNG states."""
from __future__ import annotations

import json
import os
import random

import h5py
import numpy as np
import pytest
import torch
from torch import nn

from deepfusion.engine.checkpoint import store as ckpt
from deepfusion.engine.checkpoint.store import (
    CheckpointError,
    capture_rng_state,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    restore_rng_state,
    save_checkpoint,
)
from tests.faults.files import make_unsealed, unseal


def _model(channels_last=False):
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.Tanh(),
        nn.Conv2d(4, 1, 3, padding=1),
    )
    if channels_last:
        m = m.to(memory_format=torch.channels_last)
    return m


_X = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(1))


def _loss(m):
    return (m(_X) ** 2).mean() + m[0].weight.abs().sum() * 1e-3


def _make_opt(name, params):
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-2, betas=(0.9, 0.99), weight_decay=1e-4)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, nesterov=True)
    if name == "lamb":  # DeepFusion's own (torch has none)
        from deepfusion.engine.train.firstorder import Lamb

        return Lamb(params, lr=1e-2, betas=(0.9, 0.99), weight_decay=1e-4)
    # DeepFusion's L-BFGS (torch's, with gradients gathered so channels_last weights work).
    from deepfusion.engine.train.lbfgs import DistLBFGS

    return DistLBFGS(params, lr=0.5, history_size=5, max_iter=4, line_search_fn="strong_wolfe")


def _step(m, opt):
    def closure():
        m.zero_grad()  # the module's: DeepFusion's own optimisers have no zero_grad
        loss = _loss(m)
        loss.backward()
        return loss

    if isinstance(opt, torch.optim.LBFGS):
        opt.step(closure)
    else:
        closure()
        opt.step()


def _assert_same(a, b, where="state"):
    """Exact structural equality: same Python types, bit-identical tensors (tuple ~ list ok)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(
            a.view(torch.uint8 if a.element_size() == 1 else torch.int16 if a.element_size() == 2
                   else torch.int32 if a.element_size() == 4 else torch.int64),
            b.view(torch.uint8 if b.element_size() == 1 else torch.int16 if b.element_size() == 2
                   else torch.int32 if b.element_size() == 4 else torch.int64))), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b), f"{where}: {type(a)} vs {type(b)}"
        assert a == b or (isinstance(a, float) and np.isnan(a) and np.isnan(b)), where


@pytest.mark.parametrize("opt_name", ["adam", "sgd", "lamb", "lbfgs"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_model_and_optimizer_round_trip_and_identical_continuation(tmp_path, opt_name,
                                                                   channels_last):
    m = _model(channels_last)
    opt = _make_opt(opt_name, m.parameters())
    for _ in range(3):
        _step(m, opt)
    path = checkpoint_path(tmp_path, 3)
    meta = {"step": 3, "epoch": 1, "config": {"optim": {"name": opt_name}}, "world_size": 2}
    save_checkpoint(path, model_state=m.state_dict(), optim_state=opt.state_dict(),
                    rng_state=capture_rng_state(), meta=meta)
    assert os.path.basename(path) == "step_00000003.h5"
    assert not [p for p in os.listdir(os.path.dirname(path)) if ".tmp." in p]

    got = load_checkpoint(path)
    assert set(got) == {"model_state", "optim_state", "rng_state", "meta"}
    assert got["meta"] == meta
    _assert_same(m.state_dict(), got["model_state"], "model")
    _assert_same(opt.state_dict(), got["optim_state"], "optim")

    # Restore into fresh objects and continue: identical steps, bit for bit.
    m2 = _model(channels_last)
    with torch.no_grad():
        for p in m2.parameters():
            p.add_(1.0)  # make sure the load really overwrites
    m2.load_state_dict(got["model_state"])
    opt2 = _make_opt(opt_name, m2.parameters())
    opt2.load_state_dict(got["optim_state"])
    for _ in range(3):
        _step(m, opt)
        _step(m2, opt2)
    for (n, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), n


def test_lbfgs_state_contents_round_trip_types(tmp_path):
    m = _model()
    opt = _make_opt("lbfgs", m.parameters())
    for _ in range(2):
        _step(m, opt)
    state = opt.state_dict()["state"][0]
    assert {"old_dirs", "old_stps", "ro", "d", "t", "H_diag", "prev_flat_grad", "prev_loss",
            "n_iter", "func_evals"} <= set(state)
    path = tmp_path / "c.h5"
    save_checkpoint(path, model_state={}, optim_state=opt.state_dict(), rng_state={}, meta={})
    back = load_checkpoint(path)["optim_state"]["state"][0]
    assert isinstance(back["old_dirs"], list) and all(
        isinstance(t, torch.Tensor) for t in back["old_dirs"])
    assert type(back["n_iter"]) is int and type(back["func_evals"]) is int
    assert type(back["prev_loss"]) is type(state["prev_loss"])
    _assert_same(state, back, "lbfgs")


def test_generic_values_round_trip_exactly(tmp_path):
    weird = {
        "state": {0: {"step": torch.tensor(3.0)}, 7: {"x": None}},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 7], "fused": None,
                          "name": "a/b", "flag": True, "big": 2 ** 70, "neg0": -0.0,
                          "nan": float("nan"), "inf": float("inf")}],
        "mixed": [None, torch.arange(3), 1, 2.0, "s", (1, (2, 3))],
        "keys": {1: "int", "1": "str", "": "empty", ".": "dot"},
        "tensors": {
            "f64": torch.randn(2, 3, dtype=torch.float64),
            "bf16": torch.randn(5).to(torch.bfloat16),
            "f16": torch.randn(5).half(),
            "i64_0d": torch.tensor(42),
            "bool": torch.tensor([True, False]),
            "u8": torch.arange(10, dtype=torch.uint8),
            "c64": torch.randn(3, dtype=torch.complex64),
            "empty": torch.zeros(0, 3),
            "noncontig": torch.randn(4, 6).t(),
        },
        "np": {"arr": np.arange(5, dtype=np.uint32), "scalar": np.float32(1.5),
               "i": np.int64(-3)},
    }
    path = tmp_path / "g.h5"
    save_checkpoint(path, model_state={"w.0/x": torch.ones(2)}, optim_state=weird,
                    rng_state={}, meta={"step": 1})
    got = load_checkpoint(path)
    assert list(got["model_state"]) == ["w.0/x"]
    back = got["optim_state"]
    assert back["param_groups"][0]["betas"] == (0.9, 0.999)
    assert type(back["param_groups"][0]["betas"]) is tuple
    assert back["param_groups"][0]["big"] == 2 ** 70
    assert str(back["param_groups"][0]["neg0"]) == "-0.0"
    assert list(back["keys"]) == [1, "1", "", "."]
    assert back["mixed"][5] == (1, (2, 3))
    assert type(back["np"]["scalar"]) is np.float32 and back["np"]["scalar"] == 1.5
    assert type(back["np"]["i"]) is np.int64
    assert back["np"]["arr"].dtype == np.uint32
    _assert_same({k: v for k, v in weird.items() if k != "np"},
                 {k: v for k, v in back.items() if k != "np"})


def test_unsupported_values_are_rejected_without_leaving_files(tmp_path):
    path = checkpoint_path(tmp_path, 1)
    with pytest.raises(CheckpointError, match="cannot save a value of type object"):
        save_checkpoint(path, model_state={}, optim_state={"x": object()}, rng_state={},
                        meta={})
    with pytest.raises(CheckpointError, match="JSON"):
        save_checkpoint(path, model_state={}, optim_state={}, rng_state={},
                        meta={"bad": object()})
    with pytest.raises(CheckpointError, match="model_state"):
        save_checkpoint(path, model_state={"w": 1.0}, optim_state={}, rng_state={}, meta={})
    d = os.path.dirname(path)
    assert not os.path.exists(d) or os.listdir(d) == []


def test_no_pickle_anywhere(tmp_path):
    m = _model()
    opt = _make_opt("adam", m.parameters())
    _step(m, opt)
    path = tmp_path / "p.h5"
    save_checkpoint(path, model_state=m.state_dict(), optim_state=opt.state_dict(),
                    rng_state=capture_rng_state(np.random.default_rng(0)), meta={"step": 1})

    kinds = set()

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset):
            assert obj.dtype.kind != "O" or h5py.check_string_dtype(obj.dtype), name
            kinds.add(obj.attrs["__type__"])

    with h5py.File(path, "r") as f:
        f.visititems(visit)
        assert f["model/0.weight"].attrs["__type__"] == "tensor"
        assert f["optim/state/0/exp_avg"].attrs["torch_dtype"] == "float32"
        assert f["rng/torch"][()].dtype == np.uint8
        json.loads(f["rng/numpy"].asstr()[()])  # numpy bit-generator state as JSON text
        assert f.attrs["complete"] and f.attrs["step"] == 1
    assert kinds <= {"tensor", "json", "json_tuple", "ndarray", "npscalar"}
    src = open(ckpt.__file__).read()
    assert "pickle" not in src.replace("No pickle", "").replace("never unpickles", "")
    assert "allow_pickle" not in src and "torch.load" not in src


def test_rng_states_round_trip(tmp_path):
    gen = np.random.default_rng(123)
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    torch.rand(3), gen.random(3), random.random(), np.random.rand(2)  # advance a little
    path = tmp_path / "r.h5"
    for np_gen in (gen, None):
        state = capture_rng_state(np_gen)
        save_checkpoint(path, model_state={}, optim_state={}, rng_state=state, meta={})
        expect = (torch.rand(5), (np_gen or np.random).random(4), random.random())
        torch.rand(11), (np_gen or np.random).random(9), random.random()  # move on
        restore_rng_state(load_checkpoint(path)["rng_state"], np_gen)
        got = (torch.rand(5), (np_gen or np.random).random(4), random.random())
        assert torch.equal(expect[0], got[0])
        assert np.array_equal(expect[1], got[1])
        assert expect[2] == got[2]


def _save_small(path, step=1):
    save_checkpoint(path, model_state={"w": torch.ones(3)}, optim_state={}, rng_state={},
                    meta={"step": step})


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint not found: .*nope.h5"):
        load_checkpoint(tmp_path / "nope.h5")


def test_truncated_file_gives_clear_error(tmp_path):
    good = checkpoint_path(tmp_path, 1)
    bad = checkpoint_path(tmp_path, 2)
    save_checkpoint(good, model_state=_model().state_dict(), optim_state={}, rng_state={},
                    meta={})
    data = open(good, "rb").read()
    with open(bad, "wb") as fh:
        fh.write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"truncated or corrupt.*use an earlier one: "
                                              r".*step_00000001\.h5"):
        load_checkpoint(bad)
    with open(bad, "wb") as fh:
        fh.write(b"not an hdf5 file at all")
    with pytest.raises(CheckpointError, match="not a valid HDF5 file"):
        load_checkpoint(bad)
    assert latest_checkpoint(tmp_path) == good


@pytest.mark.full
def test_file_without_marker_is_incomplete(tmp_path):
    """The completion mark is the seal; an unsealed file of an earlier DeepFusion has its
    ``complete`` attribute."""
    good = checkpoint_path(tmp_path, 5)
    _save_small(good, 5)
    bad = checkpoint_path(tmp_path, 6)
    _save_small(bad, 6)
    unseal(bad)
    with pytest.raises(CheckpointError, match=r"incomplete or damaged checkpoint "
                                              r".*step_00000006\.h5: it does not end with the "
                                              r"whole-file digest .*; "
                                              r"use an earlier one: .*step_00000005\.h5"):
        load_checkpoint(bad)
    assert latest_checkpoint(tmp_path) == good
    make_unsealed(bad, version=2)
    with h5py.File(bad, "a") as f:
        del f.attrs["complete"]
    with pytest.raises(CheckpointError, match=r"incomplete checkpoint .*step_00000006\.h5 "
                                              r"\(written while the job was killed\?\); "
                                              r"use an earlier one: .*step_00000005\.h5"):
        load_checkpoint(bad)
    assert latest_checkpoint(tmp_path) == good


def test_not_a_checkpoint(tmp_path):
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        f["x"] = 1
    with pytest.raises(CheckpointError, match="not a DeepFusion checkpoint"):
        load_checkpoint(path)


def test_latest_ignores_temp_files_and_empty_dirs(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "missing") is None
    _save_small(checkpoint_path(tmp_path, 10), 10)
    _save_small(checkpoint_path(tmp_path, 20), 20)
    # A newer checkpoint killed mid-write: its temp file lingers (complete or not).
    tmp = checkpoint_path(tmp_path, 30) + ".tmp.4242"
    _save_small(checkpoint_path(tmp_path, 30), 30)
    os.replace(checkpoint_path(tmp_path, 30), tmp)
    open(checkpoint_path(tmp_path, 40) + ".tmp.99", "wb").write(b"\x89HDF partial")
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 20)
    meta = load_checkpoint(latest_checkpoint(tmp_path))["meta"]
    assert meta == {"step": 20}


def test_failed_save_leaves_previous_file_intact(tmp_path, monkeypatch):
    path = checkpoint_path(tmp_path, 1)
    _save_small(path, 1)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "write_dict", boom)
    with pytest.raises(OSError, match="disk full"):
        _save_small(path, 2)
    monkeypatch.undo()
    assert load_checkpoint(path)["meta"] == {"step": 1}
    assert os.listdir(os.path.dirname(path)) == ["step_00000001.h5"]


def test_prune_keeps_newest(tmp_path):
    for step in (1, 2, 3, 10, 11):
        _save_small(checkpoint_path(tmp_path, step), step)
    tmp = checkpoint_path(tmp_path, 12) + ".tmp.1"  # PID 1 exists: maybe a save in progress
    open(tmp, "wb").write(b"partial")
    removed = prune_checkpoints(tmp_path, keep=2)
    names = sorted(os.listdir(os.path.join(tmp_path, "checkpoints")))
    assert names == ["step_00000010.h5", "step_00000011.h5", "step_00000012.h5.tmp.1"]
    assert len(removed) == 3
    assert prune_checkpoints(tmp_path, keep=2) == []
    with pytest.raises(ValueError):
        prune_checkpoints(tmp_path, keep=0)


def test_prune_does_not_count_incomplete_files(tmp_path):
    for step in (1, 2, 3):
        _save_small(checkpoint_path(tmp_path, step), step)
    with h5py.File(checkpoint_path(tmp_path, 3), "a") as f:
        del f.attrs["complete"]
    prune_checkpoints(tmp_path, keep=1)
    names = sorted(os.listdir(os.path.join(tmp_path, "checkpoints")))
    # step 3 is unusable, so step 2 is the newest kept; step 3 is left for inspection.
    assert names == ["step_00000002.h5", "step_00000003.h5"]
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 2)


def test_checkpoint_path_format(tmp_path):
    assert checkpoint_path("runs/x", 1234) == os.path.join("runs/x", "checkpoints",
                                                          "step_00001234.h5")
    with pytest.raises(ValueError):
        checkpoint_path("runs/x", -1)


def test_module_imports_no_pde_or_mpi():
    src = open(ckpt.__file__).read()
    assert "mpi4py" not in src and "diffnet" not in src
    from deepfusion import config

    src = open(config.__file__).read()
    assert "mpi4py" not in src and "import diffnet" not in src and "from diffnet" not in src
