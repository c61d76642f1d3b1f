"""Prolonged levels (``prolong = true``): the Prolonged generator (starts as the interpolated
coarse answer, rebuilds from its config, is its inner network on other grids), the schedule's
checks, and with real processes: the same losses on any P across growths, a kill and a rollback
across a growth resumed on the same trajectory, and the grown network answering from its
checkpoint. Tiny grids 16 -> 32 -> 64."""
import json
import os

import pytest
import torch

from deepfusion.engine.predict.loader import load_model
from deepfusion.config import ConfigError, load_config
from deepfusion.engine.checkpoint.store import latest_checkpoint
from tests.faults.steps import fault_env
from deepfusion.engine.train.plan import plan, signature
from diffnet.generators import Prolonged, build_generator
from diffnet.resample import resample_nodes
from tests.in_process import deepfusion_here
from tests.mpi_util import commands, deepfusion
from tests.test_engine_mpi import losses, train
from tests.test_multigrid import MG
from tests.tiny_configs import TINY, variant

# MG with the 32² and 64² levels grown by a depth-2 correction each
MGP = variant(MG, "model.prolong={depth = 2, base_width = 4}", "train.levels[1].prolong=true",
              "train.levels[2].prolong=true")


def unet(**kw):
    torch.manual_seed(0)
    return build_generator("unet", in_channels=2, depth=2, base_width=4, **kw).double()


def fields(grid, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((2, 2, *grid), generator=g, dtype=torch.float64)


# -- the generator (no processes) ---------------------------------------------------------------

def test_a_fresh_prolongation_answers_the_interpolated_coarse_answer():
    inner = unet()
    net = Prolonged(inner=inner, inner_grid=(16, 16), grid=(32, 32), in_channels=2,
                    correction={"depth": 2, "base_width": 4}).double()
    x = fields((32, 32))
    want = resample_nodes(inner(resample_nodes(x, (16, 16))), (32, 32))
    assert torch.equal(net(x), want)
    # on any other grid it is the inner network itself
    y = fields((48, 48))
    assert torch.equal(net(y), inner(y))
    # and it trains: the correction's zero last layer gets a gradient at once
    net(x).square().sum().backward()
    assert net.correction.outc.weight.grad.abs().sum() > 0


def test_a_frozen_inner_network_gets_no_gradient_and_the_same_answer():
    """train_inner=False: the same output, no gradient into the inner network (it runs without
    autograd), the correction trains, and a checkpoint's config rebuilds it frozen."""
    kw = dict(inner_grid=(16, 16), grid=(32, 32), in_channels=2,
              correction={"depth": 2, "base_width": 4})
    torch.manual_seed(3)
    live = Prolonged(inner=unet(), **kw).double()
    torch.manual_seed(3)
    frozen = Prolonged(inner=unet(), train_inner=False, **kw).double()
    with torch.no_grad():  # a correction that is not zero, so its gradient reaches its input
        frozen.correction.outc.weight.fill_(0.1)
        live.correction.outc.weight.fill_(0.1)
    x = fields((32, 32))
    assert torch.equal(frozen(x), live(x))
    frozen(x).square().sum().backward()
    live(x).square().sum().backward()
    assert all(p.grad is None and not p.requires_grad for p in frozen.inner.parameters())
    assert all(p.grad is not None for p in live.inner.parameters())
    for a, b in zip(frozen.correction.parameters(), live.correction.parameters()):
        assert torch.equal(a.grad, b.grad)
    again = build_generator("prolonged", **json.loads(json.dumps(frozen.config())))
    assert again.config()["train_inner"] is False
    assert not any(p.requires_grad for p in again.inner.parameters())
    with pytest.raises(ValueError, match="train_inner must be True or False"):
        Prolonged(inner=unet(), train_inner="no", **kw)


def test_a_3d_prolongation_starts_at_the_trilinear_coarse_answer():
    torch.manual_seed(0)
    inner = build_generator("unet3d", in_channels=2, depth=1, base_width=2).double()
    net = Prolonged(inner=inner, inner_grid=(4, 4, 4), grid=(8, 8, 8), in_channels=2,
                    correction={"depth": 1, "base_width": 2}).double()
    x = torch.randn((1, 2, 8, 8, 8), dtype=torch.float64)
    assert torch.equal(net(x), resample_nodes(inner(resample_nodes(x, (4, 4, 4))), (8, 8, 8)))
    assert net.config()["inner"]["name"] == "unet3d"


def test_a_nested_prolongation_rebuilds_from_its_config():
    inner = Prolonged(inner=unet(), inner_grid=(16, 16), grid=(32, 32), in_channels=2,
                      correction={"depth": 2, "base_width": 4})
    net = Prolonged(inner=inner, inner_grid=(32, 32), grid=(64, 64), in_channels=2).double()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.01 * torch.randn_like(p))
    cfg = json.loads(json.dumps(net.config()))  # what a checkpoint stores
    again = build_generator("prolonged", **cfg).double()
    again.load_state_dict(net.state_dict())
    x = fields((64, 64))
    assert torch.equal(again(x), net(x))
    assert net.grids() == [(16, 16), (32, 32), (64, 64)]


def test_a_grid_the_correction_cannot_take_is_named():
    net = Prolonged(inner=unet(), inner_grid=(16, 16), grid=(36, 36), in_channels=2)
    with pytest.raises(ValueError, match=r"correction network on \[36, 36\].*divisible"):
        net.check_input(fields((36, 36)))
    with pytest.raises(ValueError, match="finer on every axis"):
        Prolonged(inner=unet(), inner_grid=(16, 16), grid=(16, 32), in_channels=2)


# -- the schedule (no processes) ----------------------------------------------------------------

def test_the_plan_grows_at_the_first_visit_of_a_prolonged_level(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(MGP)
    v = plan(load_config(str(path)))
    assert [x.inner_grid for x in v] == [(), (16, 16), (32, 32)]
    assert signature(v)[1][-1] == "prolong" and len(signature(v)[0]) == 5
    assert [x.correction for x in v] == [{}] + [{"depth": 2, "base_width": 4}] * 2
    v = plan(load_config(str(path), ["train.levels[2].correction={base_width=2, max_width=8}"]))
    assert v[1].correction == {"depth": 2, "base_width": 4}  # model.prolong
    assert v[2].correction == {"depth": 2, "base_width": 2, "max_width": 8}  # the level's over it


@pytest.mark.parametrize("sets, key, needle", [
    (['train.cycle="v"'], "train.levels[1].prolong", "starts on the finest level"),
    (["train.levels[0].prolong=true"], "train.levels[0].prolong", "first level"),
    (['train.cycle=""', "train.levels=[{grid=[16,16], steps=1}, {grid=[32,32], steps=1}, "
      "{grid=[32,64], steps=1, prolong=true}, {grid=[64,64], steps=1}]"],
     "train.levels[2].prolong", "finer on every axis"),
    (["train.levels[0].train_inner=false"], "train.levels[0].train_inner",
     "needs prolong = true"),
    (["train.levels[0].correction={base_width=2}"], "train.levels[0].correction",
      "needs prolong = true"),
    (['train.cycle=""', "train.levels=[{grid=[16,16], steps=1}, {grid=[32,32], steps=1, "
      "prolong=true, train_inner=false}, {grid=[16,16], steps=1}, {grid=[64,64], steps=1}]"],
     "train.levels[1].train_inner", "coarser than [32, 32]"),
])
def test_bad_prolongations_are_refused_with_the_level_named(tmp_path, sets, key, needle):
    path = tmp_path / "p.toml"
    path.write_text(MGP)
    with pytest.raises(ConfigError) as e:
        load_config(str(path), sets)
    assert e.value.key == key and needle in str(e.value), str(e.value)


# -- real processes -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mgp(tmp_path_factory):
    path = tmp_path_factory.mktemp("mgp") / "mgp.toml"
    path.write_text(MGP)
    return str(path)


@pytest.fixture(scope="module")
def full(mgp, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("full") / "run")
    p = train(2, mgp, d)
    assert p.returncode == 0, p.stderr[-3000:]
    return d, p.stdout


@pytest.mark.mpi
def test_same_losses_on_any_p_across_growths_and_the_grown_network_answers(mgp, full, tmp_path):
    d, out = full
    assert "prolonging the network from 32x32" in out
    p = train(None, mgp, str(tmp_path / "p0"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert losses(str(tmp_path / "p0")) == pytest.approx(losses(d), rel=1e-9, abs=0)
    model, problem, _work, meta = load_model(latest_checkpoint(d))
    assert isinstance(model, Prolonged) and model.grids() == [(16, 16), (32, 32), (64, 64)]
    assert tuple(problem.grid) == (64, 64)
    p = deepfusion_here(["evaluate", d, "--samples", "2"])
    assert p.returncode == 0 and "test relative L2 over 2 draws" in p.stdout, p.stderr[-3000:]


@pytest.mark.mpi
@pytest.mark.full
def test_a_domain_split_across_growths_logs_the_undivided_losses(mgp, full, tmp_path):
    """Each rank holds half of every grid: the inner networks and the corrections split on
    their own grids, whole fields gathered around the resampling between them."""
    d = str(tmp_path / "split")
    p = train(2, mgp, d, "parallel.domain=[1, 2]")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "domain split" in p.stdout and "prolonging the network from 32x32" in p.stdout
    assert losses(d) == pytest.approx(losses(full[0]), rel=1e-9, abs=0)
    # and the grown network answers split over ranks as it does whole
    import h5py
    import numpy as np

    from tests.test_domain_train import infer
    got = {}
    for ranks, extra in ((0, []), (2, ["--domain", "1x2"])):
        out = str(tmp_path / f"p{ranks}.h5")
        p = infer(ranks, d, out, "--samples", "2", "--batch", "2", *extra)
        assert p.returncode == 0, p.stderr[-3000:]
        with h5py.File(out) as f:
            got[ranks] = f["u"][...]
    np.testing.assert_allclose(got[2], got[0], rtol=1e-6, atol=1e-7)


# 16x16 -> 24x24: the first network (depth 3) suits a [1, 2] split of 16x16 but not of 24x24
UNEVEN = variant(TINY, "problem.grid=[24, 24]", "model.options={depth = 3, base_width = 4}",
                 "model.prolong={depth = 2, base_width = 4}",
                 "train.levels=[{grid = [16, 16], steps = 5}, {grid = [24, 24], steps = 4, "
                 "prolong = true}]", drop=("train.epochs",))


@pytest.mark.mpi
@pytest.mark.full
def test_a_split_grown_network_need_not_suit_the_finest_grid_with_its_first_network(tmp_path):
    """Each network is split on the grids it runs on: the first on 16x16 (where it starts, not
    on problem.grid), the grown one's correction on 24x24; a rollback to before the growth
    re-splits the first network on 16x16 again."""
    cfg = tmp_path / "uneven.toml"
    cfg.write_text(UNEVEN)
    runs = {}
    for name, extra in (("whole", []), ("split", ["parallel.domain=[1, 2]"])):
        runs[name] = str(tmp_path / name)
        p = train(2, str(cfg), runs[name], *extra, "train.checkpoint_every=3",
                  'train.on_nonfinite="rollback"', env=fault_env("nan@6"))
        assert p.returncode == 0, p.stderr[-3000:]
        assert "rolled back to step_00000003.h5" in p.stderr
    assert losses(runs["split"]) == pytest.approx(losses(runs["whole"]), rel=1e-9, abs=0)


@pytest.mark.mpi
@pytest.mark.parametrize("every, fail_at", [(6, 9), (5, 7)])
@pytest.mark.full
def test_kill_after_a_growth_resumes_on_the_same_trajectory(mgp, full, tmp_path, every, fail_at):
    """Resumed from inside the grown 32x32 visit (step 6: the grown network's weights), and from
    the 16x16 -> 32x32 boundary (step 5: the growth is replayed on entering)."""
    cut = str(tmp_path / "cut")
    p = train(2, mgp, cut, f"train.checkpoint_every={every}", env=fault_env(f"raise@{fail_at}:1"))
    assert p.returncode != 0 and f"injected failure at step {fail_at}" in p.stderr
    p = deepfusion(2, ["train", "--resume", cut])
    assert p.returncode == 0, p.stderr[-3000:]
    assert losses(cut) == losses(full[0])


# the 64x64 level with its inner network frozen and a cheaper correction than model.prolong's
LEVEL = ("train.levels[2].correction={base_width=2}", "train.levels[2].train_inner=false")


@pytest.fixture(scope="module")
def frozen(mgp, tmp_path_factory):
    """``mgp`` with ``LEVEL`` from the start on P = 2, a checkpoint on entering the 64x64 level
    (step 7): (run dir, stdout). The frozen-network test and the changed-level resume test
    read it."""
    d = str(tmp_path_factory.mktemp("frozen") / "run")
    p = train(2, mgp, d, *LEVEL, "train.checkpoint_every=7")
    assert p.returncode == 0, p.stderr[-3000:]
    return d, p.stdout


@pytest.mark.mpi
@pytest.mark.full
def test_a_frozen_inner_network_leaves_the_level_unchanged_on_any_p(mgp, frozen, tmp_path):
    """train_inner = false on the 64x64 level: the 32x32 network it grows from ends the run
    with the weights it had on entering (the step-7 checkpoint), on P = 1 and 2 alike."""
    d, out = frozen
    assert "prolonging the network from 32x32 (kept frozen)" in out
    p = train(None, mgp, str(tmp_path / "p1"), *LEVEL, "train.checkpoint_every=7")
    assert p.returncode == 0, p.stderr[-3000:]
    assert losses(str(tmp_path / "p1")) == pytest.approx(losses(d), rel=1e-9, abs=0)
    entered = load_model(os.path.join(d, "checkpoints", "step_00000007.h5"))[0]
    final = load_model(latest_checkpoint(d))[0]
    assert final.grids() == [(16, 16), (32, 32), (64, 64)] and not final.train_inner
    before, after = entered.state_dict(), final.inner.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not torch.equal(final.correction.outc.weight, torch.zeros_like(
        final.correction.outc.weight))  # while the correction trained


@pytest.mark.mpi
@pytest.mark.full
def test_a_level_not_yet_trained_may_change_on_resume_and_the_change_is_named(mgp, frozen,
                                                                               tmp_path):
    """A kill after the step-7 checkpoint (the 32x32 level done), resumed with a cheaper
    correction network and a frozen inner one on the 64x64 level: the level has not started, so
    the run is the one configured that way from the start (``frozen``: same losses, same
    network), and the resume names the keys it changed in the log and in metrics.jsonl."""
    whole, cut = frozen[0], str(tmp_path / "cut")
    p = train(2, mgp, cut, "train.checkpoint_every=7", env=fault_env("raise@9:1"))
    assert p.returncode != 0
    p = deepfusion(2, ["train", "--resume", cut] + [a for s in LEVEL for a in ("--set", s)])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "the config differs from the checkpoint's in 2 key(s)" in p.stdout, p.stdout
    assert "train.levels[2].correction: (unset) -> {'base_width': 2}" in p.stdout
    assert losses(cut) == losses(whole)
    grown = load_model(latest_checkpoint(cut))[0]
    assert grown.correction_kwargs == {"depth": 2, "base_width": 2, "max_width": 64}
    assert grown.inner.correction_kwargs == {"depth": 2, "base_width": 4, "max_width": 64}
    with open(os.path.join(cut, "metrics.jsonl")) as f:
        resumes = [r for r in map(json.loads, f) if r.get("kind") == "resume"]
    assert [r["step"] for r in resumes] == [7] and len(resumes[0]["config_changes"]) == 2


BAD_CORRECTIONS = [
    ("{widths=3}", "train.levels[2].prolong: the correction network (model.prolong with "
                   "train.levels[2].correction over it: {'depth': 2, 'base_width': 4, 'widths'"),
    ("{depth=9}", "train.levels[2].grid = [64, 64] does not suit model 'unet' {'depth': 2, "
                  "'base_width': 4}: the correction network on [64, 64]: grid 64x64 is not "
                  "divisible by 2**depth = 512")]


@pytest.fixture(scope="module")
def bad_corrections(mgp, tmp_path_factory):
    """``train`` on P = 2 with each bad correction, the commands in one launch (each is refused
    before training): {correction: (exit code, stderr)}."""
    home = tmp_path_factory.mktemp("bad")
    argvs = [["train", mgp, "--set", f"run.dir={home / str(i)}",
              "--set", f"train.levels[2].correction={correction}"]
             for i, (correction, _) in enumerate(BAD_CORRECTIONS)]
    done = commands(2, argvs)
    return {correction: (rc, err) for (correction, _), (rc, _out, err) in
            zip(BAD_CORRECTIONS, done)}


@pytest.mark.mpi
@pytest.mark.parametrize("correction, needle", BAD_CORRECTIONS)
def test_a_bad_correction_on_a_level_is_refused_before_training(bad_corrections, correction,
                                                                 needle):
    rc, err = bad_corrections[correction]
    assert rc == 2 and needle in err, err[-3000:]


@pytest.mark.mpi
@pytest.mark.mpi
@pytest.mark.parametrize("split", [[], ["parallel.domain=[1, 2]"]])
@pytest.mark.full
def test_a_rollback_into_the_level_a_frozen_growth_wraps_trains_that_network_again(mgp, tmp_path,
                                                                                    split):
    """train_inner = false on the 32x32 level freezes the 16x16 network it wraps; a NaN on
    entering 32x32 rolls back into the 16x16 level (step 3), whose network trains again."""
    d = str(tmp_path / "nan")
    p = train(2, mgp, d, "train.levels[1].train_inner=false", "train.checkpoint_every=3",
              'train.on_nonfinite="rollback"', *split, env=fault_env("nan@6"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "rolled back to step_00000003.h5" in p.stderr
    assert len(losses(d)) == 11


@pytest.mark.full
def test_a_rollback_to_before_a_growth_regrows_the_same_network(mgp, tmp_path):
    """A NaN in the first step of the grown 32x32 visit rolls back to the boundary checkpoint
    (the 16x16 network): the network is unwrapped, reloaded, and grown again."""
    d = str(tmp_path / "nan")
    p = train(2, mgp, d, "train.checkpoint_every=5", 'train.on_nonfinite="rollback"',
              env=fault_env("nan@6"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "rolled back to step_00000005.h5" in p.stderr
    assert len(losses(d)) == 11
    assert isinstance(load_model(latest_checkpoint(d))[0], Prolonged)


