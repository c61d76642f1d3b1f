"""deepfusion.engine.firstorder: Adam and SGD take torch.optim's steps and share its
state_dict layout (checkpoints load both ways), without importing torch._dynamo."""
from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from deepfusion.engine.firstorder import SGD, Adam

CASES = [(Adam, torch.optim.Adam, dict(lr=1e-2, betas=(0.9, 0.99))),
         (Adam, torch.optim.Adam, dict(lr=3e-3, betas=(0.8, 0.999), weight_decay=1e-2)),
         (SGD, torch.optim.SGD, dict(lr=1e-2)),
         (SGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=1e-3))]


def params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype))
            for s in ((3, 4), (5,), (2, 2, 2))]


def run(opt, ps, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("ours,theirs,kw", CASES)
def test_the_steps_are_torch_optims(ours, theirs, kw, dtype):
    a, b = params(dtype), params(dtype)
    run(ours(a, **kw), a, 6)
    run(theirs(b, foreach=True, **kw), b, 6)
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=2e-6 if dtype == torch.float32 else 1e-14,
                                   atol=0)


@pytest.mark.parametrize("ours,theirs,kw", CASES)
def test_state_dicts_load_both_ways_and_continue_the_same_steps(ours, theirs, kw):
    ref = params(torch.float64)
    o = theirs(ref, foreach=True, **kw)
    run(o, ref, 3)
    mine = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    m = ours(mine, **kw)
    m.load_state_dict(copy.deepcopy(o.state_dict()))
    assert m.state_dict()["param_groups"] == o.state_dict()["param_groups"]
    run(o, ref, 3, seed=2)
    run(m, mine, 3, seed=2)
    for p, q in zip(mine, ref):
        torch.testing.assert_close(p, q, rtol=1e-14, atol=0)
    back = [torch.nn.Parameter(p.detach().clone()) for p in mine]
    t = theirs(back, foreach=True, **kw)
    t.load_state_dict(copy.deepcopy(m.state_dict()))
    run(t, back, 2, seed=3)
    run(m, mine, 2, seed=3)
    for p, q in zip(mine, back):
        torch.testing.assert_close(p, q, rtol=1e-14, atol=0)


def test_a_state_for_another_model_is_refused():
    m = Adam(params(torch.float32), lr=1e-3)
    sd = Adam(params(torch.float32)[:2], lr=1e-3).state_dict()
    with pytest.raises(ValueError, match="holds 2 parameters, the model has 3"):
        m.load_state_dict(sd)


def test_stepping_does_not_import_dynamo():
    code = ("import sys, torch\n"
            "from deepfusion.engine.firstorder import Adam\n"
            "p = [torch.nn.Parameter(torch.ones(3))]\n"
            "o = Adam(p, lr=0.1)\n"
            "p[0].grad = torch.ones(3)\n"
            "o.step(); o.load_state_dict(o.state_dict())\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
