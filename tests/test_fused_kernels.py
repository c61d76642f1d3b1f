"""The compiled instance norm + GELU kernel (diffnet.kernels): its values and gradients against
a float64 reference, independent of the thread count, the eager modules wherever it does not
apply, the build's failures named with their fix, and train.fused_kernels in the engine."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from diffnet.generators import UNet
from diffnet.kernels import FusedNormGELU, KernelUnavailable, NormGELU, fuse, fuse_norm_gelu
from diffnet.kernels import build
from diffnet.norms import InstanceNorm
from tests.in_process import deepfusion_here
from tests.mpi_util import ROOT, deepfusion
from tests.tiny_configs import TINY, variant

needs_gcc = pytest.mark.skipif(not (os.environ.get("CC") or build.shutil.which("gcc")),
                               reason="the fused kernels are built with GCC")
pytestmark = needs_gcc


def channels_last(t):
    return t.contiguous(memory_format=torch.channels_last)


def norm_of(c, seed=0):
    norm = InstanceNorm(c)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(c, generator=g) + 0.5)
        norm.bias.copy_(torch.rand(c, generator=g) - 0.5)
    return norm


def value_and_grads(fn, x, weight, bias, g):
    x, weight, bias = (t.detach().requires_grad_() for t in (x, weight, bias))
    y = fn(x, weight, bias)
    return (y,) + torch.autograd.grad(y, (x, weight, bias), g.to(y.dtype))


def reference(x, weight, bias, g):
    """float64 group norm (one channel per group) and exact GELU."""
    c = x.shape[1]
    return value_and_grads(lambda x, w, b: F.gelu(F.group_norm(x, c, w, b, 1e-5)),
                           x.double(), weight.double(), bias.double(), g.double())


@pytest.mark.parametrize("shape,offset", [((2, 16, 64, 64), 1.0), ((3, 5, 9, 7), 0.0),
                                          ((1, 128, 4, 4), -2.0), ((2, 8, 40, 40), 1e3)])
def test_values_and_gradients_match_float64(shape, offset):
    """N = H*W a multiple of the kernel's 256-row blocks and not, odd channel counts, one
    sample, and a mean 1000 standard deviations from zero (the variance must not cancel)."""
    gen = torch.Generator().manual_seed(1)
    x = channels_last(torch.randn(shape, generator=gen) * 3 + offset)
    g = channels_last(torch.randn(shape, generator=gen))
    norm = norm_of(shape[1])
    got = value_and_grads(lambda x, w, b: NormGELU.apply(x, w, b, 1e-5), x, norm.weight,
                          norm.bias, g)
    want = reference(x, norm.weight, norm.bias, g)
    assert got[0].is_contiguous(memory_format=torch.channels_last)
    assert got[1].is_contiguous(memory_format=torch.channels_last)
    for name, a, b in zip(("y", "grad x", "grad weight", "grad bias"), got, want):
        err = float((a.double() - b).abs().max() / b.abs().max())
        assert err < 2e-6, (name, err)


def test_same_bits_on_1_and_2_threads():
    x = channels_last(torch.randn(3, 24, 48, 48))
    g = channels_last(torch.randn(3, 24, 48, 48))
    norm = norm_of(24)
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            runs.append(value_and_grads(lambda x, w, b: NormGELU.apply(x, w, b, 1e-5), x,
                                        norm.weight, norm.bias, g))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_a_nan_reaches_the_output_and_the_gradient():
    """The engine stops (or rolls back) on a NaN loss: the kernel must not hide one."""
    x = channels_last(torch.randn(2, 4, 8, 8))
    x[1, 2, 3, 3] = float("nan")
    norm = norm_of(4)
    y, gx, gw, gb = value_and_grads(lambda x, w, b: NormGELU.apply(x, w, b, 1e-5), x,
                                    norm.weight, norm.bias, torch.ones_like(x))
    assert torch.isnan(y[1, 2]).all() and torch.isfinite(y[0]).all()
    assert torch.isnan(gw[2]) and torch.isnan(gx[1, 2]).all()


def fused_net():
    """A small U-Net with every kernel in it; the number of norm + GELU pairs fused."""
    net = channels_last_net()
    return net, fuse(net)["norm_gelu"]


def channels_last_net(**kw):
    torch.manual_seed(0)
    return UNet(in_channels=1, depth=2, base_width=4, **kw).to(memory_format=torch.channels_last)


def test_fuse_replaces_every_pair_and_keeps_the_state_dict():
    plain = channels_last_net()
    net, fused = fused_net()
    assert fused == 2 * (1 + 2 + 2) == sum(isinstance(m, FusedNormGELU) for m in net.modules())
    assert not any(type(m) is nn.GELU for seq in net.modules() if isinstance(seq, nn.Sequential)
                   for m in seq)
    assert list(net.state_dict()) == list(plain.state_dict())
    net.load_state_dict(plain.state_dict())  # checkpoints load either way
    assert fuse_norm_gelu(net) == 0  # already fused
    assert fuse_norm_gelu(channels_last_net(activation="relu")) == 0


def test_the_fused_network_computes_the_eager_function():
    plain = channels_last_net()
    net, _ = fused_net()
    x = channels_last(torch.rand(2, 1, 16, 16))
    torch.testing.assert_close(net(x), plain(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", ["nchw", "bf16-autocast", "float64", "traced"])
def test_where_the_kernel_does_not_apply_the_eager_modules_run(case):
    """Bit for bit the unfused network's output: the same modules compute it."""
    plain = channels_last_net()
    net, _ = fused_net()
    x = channels_last(torch.rand(2, 1, 16, 16))
    if case == "nchw":
        plain, net, x = plain.to(memory_format=torch.contiguous_format), \
            net.to(memory_format=torch.contiguous_format), x.contiguous()
    if case == "float64":
        plain, net, x = plain.double(), net.double(), x.double()
    if case == "traced":
        net = torch.jit.trace(net, x, check_trace=False)
        plain = torch.jit.trace(plain, x, check_trace=False)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "bf16-autocast"):
        assert torch.equal(net(x), plain(x))


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    monkeypatch.setenv("DEEPFUSION_KERNEL_CACHE", str(tmp_path / "cache"))
    build.load.cache_clear()
    build.compiler_version.cache_clear()
    yield tmp_path / "cache"
    build.load.cache_clear()
    build.compiler_version.cache_clear()


def test_a_missing_compiler_is_named_with_the_fix(fresh_build, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/gcc")
    with pytest.raises(KernelUnavailable, match=r"cannot run the C compiler.*train.fused_kernels"
                                                r" = false"):
        fuse_norm_gelu(channels_last_net())


def test_a_compiler_that_is_not_gcc_is_refused(fresh_build, monkeypatch, tmp_path):
    fake = tmp_path / "clang"
    fake.write_text("#!/bin/sh\necho 'clang version 18.1.0'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    net = channels_last_net()
    with pytest.raises(KernelUnavailable, match="built with GCC.*clang version 18"):
        fuse_norm_gelu(net)
    assert not any(isinstance(m, FusedNormGELU) for m in net.modules())  # nothing changed


def test_the_build_is_cached_per_cpu(fresh_build, monkeypatch):
    build.load("norm_gelu")
    first = list(fresh_build.iterdir())
    assert len(first) == 1 and first[0].suffix == ".so"
    build.load.cache_clear()
    build.load("norm_gelu")  # from the cache: no second file
    assert list(fresh_build.iterdir()) == first
    monkeypatch.setattr(build, "cpu_flags", lambda: "another cpu")
    assert build.library_path("norm_gelu", build.compiler()) != first[0]


def test_one_openmp_runtime_in_the_process():
    """The kernel shares torch's libgomp: two runtimes would each start a thread pool."""
    code = ("import torch; from diffnet.kernels import fuse_norm_gelu; "
            "from diffnet.generators import UNet; fuse_norm_gelu(UNet(in_channels=1, depth=1)); "
            "maps = open('/proc/self/maps').read().splitlines(); "
            "print(sorted({l.split()[-1] for l in maps if 'gomp' in l}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    assert out.count("gomp") == 1, out


# width 16, so that the Winograd kernel takes the 16x16 and 8x8 levels' convolutions
FUSED = variant(TINY, "train.dtype=\"float32\"", "model.channels_last=true",
                "train.fused_kernels=true", "train.epochs=2",
                "model.options={depth = 2, base_width = 16}")


def step_losses(d):
    import json
    with open(os.path.join(d, "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f) if r["kind"] == "step"]


@pytest.mark.mpi
def test_training_with_fused_kernels_on_1_and_2_ranks(tmp_path):
    """The start-up names the library; 1 and 2 ranks log the same losses (float32 all-reduce
    rounding), as the unfused run does to float32 rounding; a run cut by its time limit and
    resumed continues the uninterrupted run bit for bit."""
    cfg = tmp_path / "fused.toml"
    cfg.write_text(FUSED)
    runs = {}
    for n in (0, 2):
        runs[n] = str(tmp_path / f"p{n}")
        p = deepfusion(n, ["train", str(cfg), "--set", f"run.dir={runs[n]}"])
        assert p.returncode == 0, p.stderr
        assert "fused kernels: 10 instance norm + GELU pair(s) from" in p.stdout
        assert "; 2 bilinear upsampling + skip concatenation(s) from" in p.stdout
        assert "; 9 3x3 convolution(s) by Winograd F(2x2, 3x3) from" in p.stdout
    assert step_losses(runs[2]) == pytest.approx(step_losses(runs[0]), rel=1e-5)
    plain = str(tmp_path / "plain")
    p = deepfusion_here(["train", str(cfg), "--set", f"run.dir={plain}",
                         "--set", "train.fused_kernels=false"])
    assert p.returncode == 0, p.stderr
    assert "fused kernels: off; train.fused_kernels = true runs this step" in p.stdout
    assert step_losses(plain) == pytest.approx(step_losses(runs[0]), rel=1e-4)
    cut = str(tmp_path / "cut")
    p = deepfusion_here(["train", str(cfg), "--set", f"run.dir={cut}",
                         "--set", "train.time_limit_minutes=1e-9"])
    assert p.returncode == 99, p.stderr
    p = deepfusion_here(["train", "--resume", cut, "--set", "train.time_limit_minutes=0"])
    assert p.returncode == 0, p.stderr
    assert step_losses(cut) == step_losses(runs[0])


@pytest.mark.parametrize("extra,hint", [
    ("train.fused_kernels=false", True), ("train.fused_kernels=true", False),
    ("train.dtype=\"float64\"", False), ("model.channels_last=false", False),
    ("train.precision=\"bf16\"", False), ("parallel.domain=[2, 1]", False)])
def test_the_start_up_hint_only_where_the_kernels_would_take_the_step(tmp_path, extra, hint):
    from deepfusion.app.build import build_checked, fused_kernels_hint
    from deepfusion.config import load_config

    cfg = tmp_path / "fused.toml"
    cfg.write_text(FUSED)
    c = load_config(str(cfg), ["train.fused_kernels=false", extra])
    model = build_checked(c, lambda f, *a, per_rank=False: f(*a, 0) if per_rank else f(*a))[1]
    assert bool(fused_kernels_hint(c, model, c.train.precision)) is hint


@pytest.mark.parametrize("extra,message", [
    ("parallel.domain=[2, 1]", "train.fused_kernels = true with parallel.domain"),
    ("train.compile=true", "train.fused_kernels = true with train.compile = true")])
def test_refused_combinations_name_the_fix(tmp_path, extra, message):
    """Refused by the start-up checks (here by ``deepfusion check`` for a job of 2 ranks)."""
    cfg = tmp_path / "fused.toml"
    cfg.write_text(FUSED)
    p = deepfusion(0, ["check", str(cfg), "--ranks", "2", "--set", f"run.dir={tmp_path / 'run'}",
                       "--set", extra])
    assert p.returncode != 0
    assert message in p.stderr and "false" in p.stderr, p.stderr


def test_the_package_example_runs():
    import doctest

    import diffnet.kernels

    result = doctest.testmod(diffnet.kernels)
    assert result.attempted and not result.failed


def test_deepfusion_check_refuses_a_host_without_gcc_before_the_queue(tmp_path):
    cfg = tmp_path / "fused.toml"
    cfg.write_text(FUSED)
    env = dict(os.environ, CC="/nonexistent/gcc", DEEPFUSION_KERNEL_CACHE=str(tmp_path / "kc"),
               PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "deepfusion", "check", str(cfg), "--ranks", "2"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert p.returncode == 2, p.stderr
    assert "train.fused_kernels = true: cannot run the C compiler" in p.stderr
    assert "module load gcc" in p.stderr and "train.fused_kernels = false" in p.stderr
