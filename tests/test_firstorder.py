"""deepfusion.engine.train.firstorder: Adam and SGD take torch.optim's steps and share its
state_dict layout (checkpoints load both ways), without importing torch._dynamo; LAMB takes the
steps of a per-tensor reference written out here."""
from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from deepfusion.engine.train import firstorder
from deepfusion.engine.train.firstorder import SGD, Adam, Lamb

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


@pytest.mark.parametrize("kw", [dict(lr=1e-2, betas=(0.9, 0.99)),
                                dict(lr=3e-3, betas=(0.8, 0.999), weight_decay=1e-2)])
def test_adam_is_atens_fused_kernel_bit_for_bit_on_channels_last_gradient_views(kw, monkeypatch):
    """float32 Adam runs torch.optim.Adam(fused=True)'s kernel: the same parameters bit for bit,
    with channels_last weights whose gradients are strided views of one flat buffer (as
    GradSync makes them); the foreach path (no fused kernel) within rounding of it."""
    def weights():
        g = torch.Generator().manual_seed(0)
        ws = [torch.randn(s, generator=g) for s in ((8, 4, 3, 3), (8,), (1, 8, 1, 1))]
        return [torch.nn.Parameter(w.contiguous(memory_format=torch.channels_last)
                                   if w.dim() == 4 else w) for w in ws]

    def steps(opt, ps):
        g = torch.Generator().manual_seed(1)
        flat = torch.zeros(sum(p.numel() for p in ps))
        off = 0
        for p in ps:
            p.grad = flat.as_strided(p.shape, p.stride(), off)
            off += p.numel()
        for _ in range(5):
            flat.copy_(torch.randn(flat.shape, generator=g))
            opt.step()

    a, b, c = weights(), weights(), weights()
    steps(Adam(a, **kw), a)
    steps(torch.optim.Adam(b, fused=True, **kw), b)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    monkeypatch.setattr(firstorder, "FUSED_ADAM", None)
    steps(Adam(c, **kw), c)
    for p, q in zip(c, a):
        torch.testing.assert_close(p, q, rtol=2e-6, atol=0)


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
            "from deepfusion.engine.train.firstorder import Adam\n"
            "p = [torch.nn.Parameter(torch.ones(3))]\n"
            "o = Adam(p, lr=0.1)\n"
            "p[0].grad = torch.ones(3)\n"
            "o.step(); o.load_state_dict(o.state_dict())\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def lamb_reference(ps, state, lr, betas, eps, wd):
    """One LAMB step, one tensor at a time, as the paper writes it (Algorithm 2)."""
    b1, b2 = betas
    for i, p in enumerate(ps):
        m, v, n = state.setdefault(i, [torch.zeros_like(p), torch.zeros_like(p), 0])
        n += 1
        state[i][2] = n
        m.mul_(b1).add_(p.grad, alpha=1 - b1)
        v.mul_(b2).add_(p.grad * p.grad, alpha=1 - b2)
        r = (m / (1 - b1 ** n)) / ((v / (1 - b2 ** n)).sqrt() + eps) + wd * p.detach()
        pn, rn = p.detach().norm().item(), r.norm().item()
        phi = pn / rn if pn > 0 and rn > 0 else 1.0
        with torch.no_grad():
            p.sub_(lr * phi * r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("wd", [0.0, 1e-2])
def test_lamb_takes_the_per_tensor_reference_steps(dtype, wd):
    """Including a tensor that starts at zero (a bias: phi = 1 at the first step) and one whose
    gradient is zero throughout (r = wd * p: without decay it never moves)."""
    kw = dict(lr=2e-2, betas=(0.9, 0.99), weight_decay=wd)
    a, b = params(dtype), params(dtype)
    for ps in (a, b):
        ps[0].data.mul_(10.0)  # a trust ratio far from 1
        ps[1].data.zero_()
        ps.append(torch.nn.Parameter(torch.randn(3, dtype=dtype)))
    b[3].data.copy_(a[3])
    opt, state = Lamb(a, **kw), {}
    frozen = a[3].detach().clone()
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        for p, q in zip(a, b):
            p.grad = torch.randn(p.shape, generator=g, dtype=dtype)
            q.grad = p.grad.clone()
        a[3].grad.zero_()
        b[3].grad.zero_()
        opt.step()
        lamb_reference(b, state, kw["lr"], kw["betas"], 1e-6, wd)
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-5 if dtype == torch.float32 else 1e-12,
                                   atol=0)
    assert a[1].abs().sum() > 0  # the zero tensor moved
    assert torch.equal(a[3], frozen) == (wd == 0.0)
    if wd:  # with decay the zero-gradient tensor shrinks by lr x its norm per step
        assert a[3].norm().item() == pytest.approx(frozen.norm().item() * (1 - kw["lr"]) ** 5,
                                                  rel=1e-5)


def test_lamb_moves_each_tensor_by_lr_times_its_norm_and_its_state_continues():
    """A step is relative to each tensor's size, whatever the gradient's scale; the state has
    Adam's keys, and a Lamb loaded from it continues the same steps bit for bit."""
    ps = params(torch.float64)
    before = [p.detach().clone() for p in ps]
    o = Lamb(ps, lr=1e-2)
    run(o, ps, 1)
    for p, q in zip(ps, before):
        assert (p - q).norm().item() == pytest.approx(1e-2 * q.norm().item(), rel=1e-12)
    assert set(o.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    mine = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    m = Lamb(mine, lr=1e-2)
    m.load_state_dict(copy.deepcopy(o.state_dict()))
    run(o, ps, 3, seed=2)
    run(m, mine, 3, seed=2)
    for p, q in zip(mine, ps):
        assert torch.equal(p, q)
