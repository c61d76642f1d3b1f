"""L-BFGS (deepfusion/engine/train/lbfgs.py): in-process unit tests and real ``mpiexec -n 2`` runs."""
import os
import sys

import numpy as np
import pytest
import torch

from deepfusion.config import ConfigError, load_config
from deepfusion.engine.checkpoint import store as ckpt
from deepfusion.engine.train import lbfgs
from deepfusion.engine.parallel.comm import SerialComm
from deepfusion.engine.parallel.data import LazyBatch
from deepfusion.engine.train.firstorder import Adam, Lamb
from deepfusion.engine.train.optimizer import OptimizerSchedule, build_stepper
from tests.mpi_util import run_mpi
from tests.tiny_configs import TINY, variant

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "mpi_scripts"))
from lbfgs_common import LinearLSQ, flat_params, lbfgs_cfg, linear_model, make_engine  # noqa: E402


def lsq_batch(n=16, seed=5):
    lin = LinearLSQ()
    return lin, lin.build_input(lin.sample_params(seed, range(n)))


# ---- in-process ---------------------------------------------------------------------------------

def test_converges_to_the_known_minimiser_of_a_convex_problem():
    lin, x = lsq_batch()
    model = linear_model(0)
    _, _, opt, step = make_engine(model, lin, SerialComm(), global_batch=16,
                                  cfg=lbfgs_cfg(max_iter=30, tol_grad=1e-14, tol_change=0.0))
    res = [step.run(x) for _ in range(2)]
    w = flat_params(model).numpy()[[0, 1, 2]]
    np.testing.assert_allclose(w, lin.minimiser(x), rtol=1e-6, atol=1e-8)
    assert res[0].metrics["func_evals"] > 1 and res[0].metrics["lbfgs_iters"] >= 1
    assert res[0].metrics["samples_evaluated"] == 16 * res[0].metrics["func_evals"]
    assert res[-1].grad_norm < 1e-6


def test_lazy_micro_batches_give_the_same_step_as_the_whole_batch():
    lin, x = lsq_batch()
    runs = []
    for lazy in (False, True):
        model = linear_model(0)
        _, _, opt, step = make_engine(model, lin, SerialComm(), global_batch=16, micro_batch=3)
        built = []

        def build(idx):
            built.append(len(idx))
            return x[list(idx)]

        batch = LazyBatch(build, range(16), 3) if lazy else x
        r = step.run(batch)
        runs.append((flat_params(model), r.loss))
        if lazy:  # never more than one micro-batch of inputs at a time
            assert max(built) == 3 and sum(built) == 16 * r.metrics["func_evals"]
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=1e-12, atol=1e-14)


def test_channels_last_parameters_are_supported():
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(2, 3, 3, padding=1).double()
    ref = torch.nn.Conv2d(2, 3, 3, padding=1).double()
    ref.load_state_dict(conv.state_dict())
    conv = conv.to(memory_format=torch.channels_last)
    x = torch.randn(4, 2, 6, 6, dtype=torch.float64)
    out = []
    for m, cl in ((conv, True), (ref, False)):
        opt = lbfgs.DistLBFGS(list(m.parameters()), lr=1.0, max_iter=5, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            xi = x.contiguous(memory_format=torch.channels_last) if cl else x
            loss = (m(xi) - 1).pow(2).mean()
            loss.backward()
            return loss

        opt.step(closure)
        out.append(torch.cat([p.detach().reshape(-1) for p in m.parameters()]))
    torch.testing.assert_close(out[0], out[1], rtol=1e-10, atol=1e-12)


class _NaNAfter(LinearLSQ):
    """Finite loss for the first ``k`` evaluations, then NaN (a line search gone wrong)."""

    def __init__(self, k):
        self.k, self.calls = k, 0

    def loss_terms(self, u, x):
        self.calls += 1
        t = super().loss_terms(u, x)
        if self.calls > self.k:
            t["pde"] = t["pde"] * float("nan")
        return t


def test_nonfinite_inside_the_line_search_abandons_the_step_cleanly():
    task = _NaNAfter(2)
    _, x = lsq_batch()
    model = linear_model(0)
    before = flat_params(model)
    _, _, opt, step = make_engine(model, task, SerialComm(), global_batch=16)
    res = step.run(x)
    assert not res.finite and res.nonfinite_terms == ["pde"]
    assert res.metrics["func_evals"] == 3
    assert torch.equal(flat_params(model), before)  # back at the start of the step
    assert len(opt.state) == 0  # half-updated history discarded


class _WorseAt(LinearLSQ):
    """The least-squares loss, plus 1e6 at the evaluations numbered in ``worse`` (1-based): a
    line-search trial that lands higher than the step's start."""

    def __init__(self, worse):
        self.worse, self.calls = set(worse), 0

    def loss_terms(self, u, x):
        self.calls += 1
        t = super().loss_terms(u, x)
        if self.calls in self.worse:
            t["pde"] = t["pde"] + 1e6
        return t


def one_iteration_steps(worse):
    """(model, its parameters before, optimiser, stepper, inputs): lbfgs_max_iter = 1 (the
    large-batch setting) on the least-squares task worsened at the evaluations ``worse``."""
    _, x = lsq_batch()
    model = linear_model(0)
    before = flat_params(model)
    _, _, opt, step = make_engine(model, _WorseAt(worse), SerialComm(), global_batch=16,
                                  cfg=lbfgs_cfg(max_iter=1))
    return model, before, opt, step, x


def test_a_one_iteration_step_searches_past_a_rejected_full_step():
    """A full step that lands higher is followed by more trials within the step, not by no step
    at all."""
    model, before, _opt, step, x = one_iteration_steps({2})
    res = step.run(x)
    assert res.metrics["func_evals"] >= 3 and not res.metrics["lbfgs_restart"]
    assert res.metrics["loss_after"] < res.loss
    assert not torch.equal(flat_params(model), before)


def test_a_step_that_finds_nothing_lower_restarts_the_history():
    # every trial of the first step: 1 + 4 line-search evaluations
    model, before, opt, step, x = one_iteration_steps(range(2, 7))
    res = step.run(x)
    assert res.metrics["func_evals"] == 1 + lbfgs.LINE_SEARCH_EVALS
    assert res.metrics["lbfgs_restart"] and len(opt.state) == 0
    assert torch.equal(flat_params(model), before)
    res = step.run(x)  # afresh: a scaled gradient step, accepted
    assert not res.metrics["lbfgs_restart"] and res.metrics["loss_after"] < res.loss


def test_state_dict_roundtrips_through_the_hdf5_checkpoint(tmp_path):
    lin, x = lsq_batch()
    model = linear_model(1)
    _, _, opt, step = make_engine(model, lin, SerialComm(), global_batch=16,
                                  cfg=lbfgs_cfg(max_iter=2))
    step.run(x)
    path = str(tmp_path / "c.h5")
    ckpt.save_checkpoint(path, model_state=model.state_dict(), optim_state=opt.state_dict(),
                         rng_state={}, meta={"step": 1, "optimizer": "lbfgs"})
    step.run(x)
    want = flat_params(model)
    st = ckpt.load_checkpoint(path)
    m2 = linear_model(7)
    m2.load_state_dict(st["model_state"])
    _, _, opt2, step2 = make_engine(m2, lin, SerialComm(), global_batch=16, cfg=lbfgs_cfg(max_iter=2))
    opt2.load_state_dict(st["optim_state"])
    step2.run(x)
    assert torch.equal(flat_params(m2), want)


@pytest.mark.parametrize("first,cls", [("adam", Adam), ("lamb", Lamb)])
def test_optimizer_schedule_switches_and_restores_by_name(first, cls):
    cfg = load_config(None, [f"optim.name=\"{first}\"", "optim.switch_to_lbfgs_epoch=2",
                             "train.epochs=4"]).optim
    m = linear_model(0)
    _, lg, _, _ = make_engine(m, LinearLSQ(), SerialComm(), global_batch=16)
    sched = OptimizerSchedule(m.parameters(), cfg, lg)
    adam = sched.at(0)
    assert adam.name == first and type(adam.optimizer) is cls
    assert sched.at(1) is adam
    lb = sched.at(2)
    assert lb.name == "lbfgs" and sched.at(3) is lb
    # resume/rollback: rebuild whatever stepper wrote the state, by its recorded name
    sched.restore(first, adam.state_dict())
    assert sched.current.name == first and type(sched.current.optimizer) is cls
    c2 = load_config(None, ["optim.name=\"lbfgs\"", "optim.lbfgs_line_search=\"none\""]).optim
    assert build_stepper("lbfgs", m.parameters(), c2, lg).optimizer.param_groups[0]["line_search_fn"] is None
    with pytest.raises(ValueError, match="valid: adam, sgd, lamb, lbfgs"):
        build_stepper("adamw", m.parameters(), c2, lg)
    with pytest.raises(ConfigError, match="switch_to_lbfgs_epoch"):
        load_config(None, ["optim.name=\"lbfgs\"", "optim.switch_to_lbfgs_epoch=1"])


# ---- real MPI -----------------------------------------------------------------------------------

@pytest.mark.mpi
def test_same_iterates_on_1_and_2_ranks_and_resume_and_convex():
    """Plain, and with lazy micro-batches, overlapped buckets and channels_last together (the
    variants share a launch)."""
    variants = ["plain", "micro+overlap+channels-last"]
    p = run_mpi(2, ["tests/mpi_scripts/lbfgs_iterates.py"] + variants)
    assert p.returncode == 0, p.stderr[-3000:]
    for v in variants:
        assert f"OK iterates P=2 variant={v} " in p.stdout and \
            f"OK convex P=2 variant={v} " in p.stdout, p.stdout
    assert "variant=plain micro=0 overlap=False channels_last=False" in p.stdout
    assert "micro=2 overlap=True channels_last=True" in p.stdout


# Adam for 2 epochs, then L-BFGS on micro-batches of 2
SWITCH = variant(TINY, "data.global_batch=8", "data.eval_samples=0", "optim.switch_to_lbfgs_epoch=2",
                 "optim.lbfgs_max_iter=3", "optim.lbfgs_history=5", "train.checksum_every=1",
                 "train.micro_batch=2")


def test_the_config_offers_exactly_the_engines_optimisers():
    """optim.name's choices (config may not import the engine) are the steppers the engine
    builds: a new optimiser is added in both places or a config cannot name it."""
    import dataclasses

    from deepfusion.config.sections import OptimConfig
    from deepfusion.engine.train.optimizer import STEPPERS
    name = next(f for f in dataclasses.fields(OptimConfig) if f.name == "name")
    assert tuple(name.metadata["choices"]) == STEPPERS
