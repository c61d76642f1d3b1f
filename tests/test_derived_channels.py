"""Given input fields whose derived channels do not follow from the others are refused (issue
#69, item 7): a ``log_nu`` that is not the log of ``nu``, a Burgers ``t`` that is not the row's
time or a ``u0`` that changes along t. ``predict(inputs)`` raises ValueError, ``infer
--inputs`` exits 2, each naming the channel, how far off it is and the fix; consistent float32
fields (what ``infer`` itself writes) pass. The contract's ``derived_channels`` says how a
family derives them; ``check-problem`` checks it against ``build_input``."""
from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

import deepfusion
from deepfusion.app.fields_file import write_input_fields
from deepfusion.engine.checkpoint.store import save_checkpoint
from diffnet.generators import build_generator
from diffnet.problems import (PROBLEMS, Poisson, check_derived_channels, get_problem,
                              has_derived_channels)
from diffnet.problems.check.problem import check_problem
from diffnet.problems.contract.derived import RTOL, mismatches
from tests.plugins.heat import Heat

GRID = [16, 16]


def checkpoint(path, name: str) -> str:
    """An (untrained) checkpoint of problem ``name`` on 16x16, as 'deepfusion train' writes it."""
    torch.manual_seed(0)
    problem = get_problem(name, grid=GRID)
    model = build_generator("unet", in_channels=len(problem.input_channels), depth=2,
                            base_width=4)
    meta = {"step": 0, "config": {"data": {"seed": 0}, "model": {"channels_last": False}},
            "model": {"name": "unet", "kwargs": model.config()},
            "problem": {"name": name, "kwargs": problem.config()}}
    save_checkpoint(path, model_state=model.state_dict(), optim_state={}, rng_state={}, meta=meta)
    return str(path)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("ck") / "step_00000000.h5", "poisson")


# -- the contract -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_build_inputs_agree_with_their_derived_channels(name):
    """Every built-in family's own inputs pass, in float32 (a fields file) and float64; a
    family with derived channels refuses one of them moved by 1% (past the first row: a u0
    moved on every row is still one u0)."""
    p = get_problem(name, grid=(8, 8, 8) if name == "poisson3d" else (16, 16))
    params = p.sample_params(3, range(4))
    for dtype in (torch.float32, torch.float64):
        assert mismatches(p, p.build_input(params, dtype=dtype).double().numpy()) == {}
    x = p.build_input(params, dtype=torch.float64).numpy()
    derived = list(p.derived_channels(x))
    assert has_derived_channels(p) == bool(derived)
    for c in derived:
        y, i = x.copy(), p.input_channels.index(c)
        y[2, i, 1:] += 0.01 * (np.abs(y[2, i]).max() + 1)
        with pytest.raises(ValueError, match=rf"here: channel '{c}' is not .* 1 of 4 samples "
                                             r"\(the most in sample 2\)"):
            check_derived_channels(p, y, "here")


def test_which_families_derive_which_channels():
    assert list(get_problem("poisson").derived_channels(
        get_problem("poisson").build_input(np.zeros((1, 4))).double().numpy())) == ["log_nu"]
    b = get_problem("burgers", grid=(16, 16))
    assert sorted(b.derived_channels(b.build_input([[4.0]]).double().numpy())) == ["t", "u0"]
    # a family that derives nothing is not checked (the contract's default)
    assert not has_derived_channels(Heat) and Heat.derived_channels is not Poisson.derived_channels
    h = Heat(grid=(16, 16))
    x = h.build_input(h.sample_params(0, range(2))).double().numpy()
    check_derived_channels(h, x + 5.0, "here")


def test_rounding_passes_a_real_mismatch_does_not():
    """The tolerance: float32 rounding of nu and of log_nu passes; a relative mismatch a few
    times RTOL does not; a non-positive nu (no log) is a mismatch, not a crash."""
    p = get_problem("poisson", grid=(16, 16))
    x = p.build_input(p.sample_params(0, range(2)), dtype=torch.float64).numpy()
    # nu near 1 everywhere: log_nu near 0, where only the absolute floor keeps rounding apart
    x32 = np.stack([np.full((2, 16, 16), 1.0 + 3e-7), np.full((2, 16, 16), np.log(1.0 + 3e-7))],
                   axis=1).astype(np.float32).astype(np.float64)
    assert mismatches(p, x32) == {}
    y = x.copy()
    y[:, 1] *= 1 + 5 * RTOL
    assert list(mismatches(p, y)) == ["log_nu"]
    y = x.copy()
    y[0, 0, 3, 3] = -1.0
    assert mismatches(p, y)["log_nu"]["samples"].tolist() == [0]


# -- the Python API ---------------------------------------------------------------------------
def test_predict_refuses_inconsistent_channels(ckpt):
    s = deepfusion.load(ckpt)
    x = s.inputs(s.sample(3, seed=1))
    u = s.predict(x.astype(np.float32))            # float32 fields, as a file holds them
    assert u.shape == (3, 16, 16)
    nu, log_nu = x[:, 0], x[:, 1]
    bad = x.copy()
    bad[1, 1] = np.log(nu[1]) + 0.2
    want = (r"predict\(inputs\): channel 'log_nu' is not log\(nu\), as problem 'poisson' "
            r"derives it from the other channels: it differs by up to 0.2 .* in 1 of 3 samples "
            r"\(the most in sample 1\).*give 'log_nu' = log\(nu\) \(or 'nu' alone")
    with pytest.raises(ValueError, match=want):
        s.predict(bad)
    with pytest.raises(ValueError, match=want):
        s.predict(torch.from_numpy(bad))
    with pytest.raises(ValueError, match="channel 'log_nu' is not log"):
        s.predict({"nu": nu, "log_nu": 2 * log_nu})
    # the fix the message names: nu alone, log_nu derived; the same answers as consistent fields
    assert np.allclose(s.predict({"nu": nu}), s.predict(x), atol=1e-6)


# -- infer --inputs ---------------------------------------------------------------------------
def test_infer_refuses_an_inconsistent_file_and_takes_its_own(ckpt, tmp_path, cli):
    out = tmp_path / "p.h5"
    assert cli(["infer", ckpt, "--samples", "3", "--out", str(out)])[0] == 0
    with h5py.File(out) as f:
        x = f["inputs"][()]                         # float32, as infer writes them
    assert x.dtype == np.float32
    again = tmp_path / "again.h5"
    src = str(tmp_path / "own.h5")
    write_input_fields(src, x, ["nu", "log_nu"], problem="poisson")
    assert cli(["infer", ckpt, "--inputs", src, "--out", str(again)])[0] == 0
    bad = x.copy()
    bad[:, 1] = np.log(x[:, 0]) * 1.22
    src = str(tmp_path / "bad.h5")
    write_input_fields(src, bad, ["nu", "log_nu"], problem="poisson")
    refused = tmp_path / "refused.h5"
    rc, _, err = cli(["infer", ckpt, "--inputs", src, "--out", str(refused)])
    assert rc == 2 and "Traceback" not in err, err
    assert f"--inputs {src}: channel 'log_nu' is not log(nu)" in err and "3 of 3 samples" in err
    assert not refused.exists()


def test_burgers_time_and_initial_rows(tmp_path, cli):
    ck = checkpoint(tmp_path / "step_00000000.h5", "burgers")
    s = deepfusion.load(ck)
    x = s.inputs(s.sample(2))
    s.predict(x)
    late = x.copy()
    late[:, 1] = 1.0 - late[:, 1]                  # time running backwards
    with pytest.raises(ValueError, match="channel 't' is not the normalised time of its row"):
        s.predict(late)
    drift = x.copy()
    drift[1, 0, 5:] += 0.3                          # u0 changing along t
    with pytest.raises(ValueError, match=r"channel 'u0' is not its first row \(t = 0\) repeated "
                                         r"on every row.* 1 of 2 samples"):
        s.predict(drift)
    src = str(tmp_path / "late.h5")
    write_input_fields(src, late, ["u0", "t"], problem="burgers")
    rc, _, err = cli(["infer", ck, "--inputs", src, "--out", str(tmp_path / "p.h5")])
    assert rc == 2 and "channel 't' is not" in err and "Traceback" not in err


# -- a plugin's declaration, checked by check-problem ---------------------------------------
class WrongDerivation(Poisson):
    """Declares log_nu as 2 log(nu), which its build_input does not make."""

    name = "wrong_derivation"

    def derived_channels(self, inputs):
        return {"log_nu": 2 * np.log(inputs[:, 0])}


def test_check_problem_names_a_declaration_build_input_breaks():
    result = {r.check: r for r in check_problem(WrongDerivation).results}["inputs_from_fields"]
    assert result.status == "FAIL" and result.method == "derived_channels"
    assert "differs from build_input's by up to" in result.detail
    ok = {r.check: r for r in check_problem("poisson").results}["inputs_from_fields"]
    assert ok.status == "OK" and "derived channels agree" in ok.detail
