"""One training step, side by side in one process: DeepFusion's step against a plain PyTorch
loop, as a fraction of the machine's fp32 GEMM rate.

    python -m bench.step_bench [--grids 64:16,256:2] [--threads 1,2] [--repeats 5] [--compile]
                               [--bf16]

Configurations (same problem, generator, global batch, initial weights), timed in turn:
  plain            eager NCHW, stock nn.InstanceNorm2d, torch.optim.Adam defaults,
                   loss.backward(); opt.step(); opt.zero_grad()
  deepfusion       the trained step: deepfusion.engine.train.step.LossAndGrad + GradSync (flat
                   buckets) + the engine's stepper (build_stepper: Adam (foreach), clipping as
                   optim.grad_clip says), channels_last, the generator's NHWC instance norm
                   (what `deepfusion train` runs)
  deepfusion_nchw  the same engine in NCHW (isolates the memory format)
  deepfusion_sliced_grad  deepfusion with the decoder's upsampling fed the sliced gradient of
                   the concatenation instead of diffnet.generators.DenseGrad (isolates it)
  deepfusion_conv_stencil_grad  deepfusion with the loss's stencils differentiated by ATen's
                   convolution backward instead of diffnet.stencils.StencilConv (isolates it)
  deepfusion_foreach_adam  deepfusion with Adam's foreach update instead of ATen's fused kernel
                   (isolates it; ``optimizer_s`` of a row is its step's optimiser phase)
  deepfusion_fused  deepfusion with train.fused_kernels = true: the compiled kernels
                   (diffnet.kernels; left out where they cannot be built)
  deepfusion_bf16  (--bf16) deepfusion under train.precision = "bf16"
  deepfusion_bf16_fp32_norm  (--bf16) the same with the norms in float32 instead of
                   diffnet.norms.InstanceNormNHWCLowPrecision (isolates it)
  deepfusion_compile  (--compile) the engine with torch.compile'd generator; with --bf16 also
                   deepfusion_bf16_compile
and one torch.mm of 2048 x 2048 per round (the GEMM limit under the same load). FLOPs of a
step are counted with torch.utils.flop_counter.FlopCounterMode over forward + backward.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from bench.common import (Timer, build, emit_json, fused, gemm_flops, gemm_seconds, inputs, load,
                          median, step_flops)


def stock_norms(model):
    """Swap the generator's InstanceNorm for torch's nn.InstanceNorm2d (same parameters)."""
    from torch import nn

    from diffnet.generators import InstanceNorm

    for name, mod in list(model.named_modules()):
        for cname, child in list(mod.named_children()):
            if isinstance(child, InstanceNorm):
                new = nn.InstanceNorm2d(child.num_features, eps=child.eps, affine=True)
                new.load_state_dict(child.state_dict())
                setattr(mod, cname, new)
    return model


def sliced_grad(model):
    """Undo ``DenseGrad`` in every ``Up`` of ``model``: the upsampling's backward then gets the
    channel slice of the concatenation's gradient, as a plain U-Net gives it (an ablation)."""
    import types

    import torch

    from diffnet.generators import Up

    def forward(self, x, skip):
        return self.block(torch.cat([self.up(x), skip], dim=1))

    for mod in model.modules():
        if type(mod) is Up:
            mod.forward = types.MethodType(forward, mod)
    return model


def foreach_adam(step):
    """``step`` (make_deepfusion's) with Adam's foreach update instead of ATen's fused kernel
    (an ablation): the kernel is switched off around each call."""
    from deepfusion.engine.train import firstorder

    def run():
        kernel, firstorder.FUSED_ADAM = firstorder.FUSED_ADAM, None
        try:
            return step()
        finally:
            firstorder.FUSED_ADAM = kernel
    run.times, run.comm = step.times, step.comm
    return run


def conv_stencil_grad(problem):
    """Give every FiniteDifference of ``problem`` ATen's convolution backward instead of
    diffnet.stencils.StencilConv's (an ablation; whole grids only, as the bench runs)."""
    import types

    import torch.nn.functional as F

    from diffnet.stencils import FiniteDifference, pad_cubic

    def forward(self, u, block=None):
        return getattr(F, f"conv{self.dims}d")(pad_cubic(u), self.weight.to(u.dtype))

    for fd in (v for v in vars(problem).values() if isinstance(v, FiniteDifference)):
        fd.forward = types.MethodType(forward, fd)
    return problem


def fp32_norms(model):
    """Run every InstanceNorm of ``model`` through the float32 NHWC kernel, which under bf16
    autocast casts its input to float32 (the bf16 step without the low-precision norm)."""
    import types

    from diffnet.generators import InstanceNorm
    from diffnet.norms import InstanceNormNHWC

    def forward(self, x):
        return InstanceNormNHWC.apply(x, self.weight, self.bias, self.eps)

    for mod in model.modules():
        if isinstance(mod, InstanceNorm):
            mod.forward = types.MethodType(forward, mod)
    return model


def make_plain(problem, model, x, lr=1e-3):
    import torch

    opt = torch.optim.Adam(model.parameters(), lr=lr)

    def step():
        u = problem.answer(model(x), x)
        terms = problem.loss_terms(u, x)
        loss = (terms["pde"] + terms["bc"]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    return step


def engine_step(loss_and_grad, params, x, optim=None):
    """step() -> StepResult: the trained optimiser step on the local batch ``x``, by the
    engine's stepper of ``optim.name`` (``build_stepper``, as the trainer builds it: the global
    loss and gradient, clipping as ``optim.grad_clip`` says, the update) at the schedule's
    first step. ``optim``: an ``[optim]`` section (default: the defaults, Adam)."""
    from deepfusion.config import OptimConfig
    from deepfusion.engine.parallel.data import LazyBatch
    from deepfusion.engine.train.optimizer import build_stepper

    cfg = optim or OptimConfig()
    stepper = build_stepper(cfg.name, params, cfg, loss_and_grad)
    batch = LazyBatch(lambda indices: x, range(x.shape[0]), 0)

    def step():
        return stepper.step(batch, step=0, schedule_steps=1, lr_scale=1.0)
    return step


def make_deepfusion(problem, model, x, *, channels_last=True, comm=None, bucket_mb=4.0,
                    overlap=False, global_batch=None, precision="fp32", poll=True):
    """The engine's step as Trainer.train_step runs it (minus data loading and logging):
    :func:`engine_step`; ``poll=False`` turns off GradSync's progress polling (an ablation of
    the overlap). ``step.times`` holds the last step's times, ``step.comm`` its gradient
    all-reduce per rank on several ranks (the step record's ``allreduce_*`` fields, as
    ``parallel.allreduce_stats`` writes them)."""
    from deepfusion.config import ParallelConfig
    from deepfusion.engine.parallel.comm import SerialComm
    from deepfusion.engine.parallel.parallelize import parallelize
    from deepfusion.engine.train.step import LossAndGrad

    comm = comm or SerialComm()
    pm = parallelize(model, comm, ParallelConfig(bucket_mb=bucket_mb, overlap=overlap))
    pm.grads.poll = poll
    lg = LossAndGrad(pm, problem, global_batch=global_batch or x.shape[0],
                     term_names=problem.loss_term_names, channels_last=channels_last,
                     precision=precision, allreduce_stats=comm.size > 1)
    trained = engine_step(lg, model.parameters(), x)
    last, last_comm = {}, {}

    def step():
        res = trained()
        last.update(res.times)
        last_comm.clear()
        last_comm.update(res.comm)
        return res.loss

    step.times, step.comm = last, last_comm
    return step


def bench_grid(grid, batch, threads, repeats, *, compile_=False, generator="unet",
               problem="burgers", gemm_n=2048, bf16=False, log=print):
    import torch

    torch.set_num_threads(threads)
    prob, base = build(problem, grid, generator, channels_last=False)
    x = inputs(prob, batch)
    flops = step_flops(base, prob, x)
    state = base.state_dict()
    configs = {}

    def fresh(cl):
        m = build(problem, grid, generator, channels_last=False)[1]
        m.load_state_dict(state)
        return m.to(memory_format=torch.channels_last) if cl else m

    configs["plain"] = make_plain(prob, stock_norms(fresh(False)), x)
    configs["deepfusion"] = make_deepfusion(prob, fresh(True), x, channels_last=True)
    configs["deepfusion_nchw"] = make_deepfusion(prob, fresh(False), x, channels_last=False)
    configs["deepfusion_sliced_grad"] = make_deepfusion(prob, sliced_grad(fresh(True)), x)
    configs["deepfusion_conv_stencil_grad"] = make_deepfusion(
        conv_stencil_grad(build(problem, grid, generator)[0]), fresh(True), x)
    configs["deepfusion_foreach_adam"] = foreach_adam(make_deepfusion(prob, fresh(True), x))
    with_kernel = fused(fresh(True))
    if with_kernel is not None:
        configs["deepfusion_fused"] = make_deepfusion(prob, with_kernel, x)
    if bf16:  # train.precision = "bf16" (autocast; the FLOP ratio is still against fp32 GEMM)
        configs["deepfusion_bf16"] = make_deepfusion(prob, fresh(True), x, precision="bf16")
        configs["deepfusion_bf16_fp32_norm"] = make_deepfusion(prob, fp32_norms(fresh(True)), x,
                                                               precision="bf16")
    compiled = {"fp32": "deepfusion_compile", "bf16": "deepfusion_bf16_compile"}
    compile_s = {}  # precision -> seconds to compile (the first call)
    for precision in (("fp32", "bf16") if bf16 else ("fp32",)) if compile_ else ():
        name = compiled[precision]
        t0 = time.perf_counter()
        configs[name] = make_deepfusion(prob, torch.compile(fresh(True)), x, precision=precision)
        configs[name]()  # compile here, not in a timed round
        compile_s[precision] = time.perf_counter() - t0
    for f in configs.values():  # warm-up (oneDNN primitive caches, allocator)
        f()
    wall = {k: [] for k in configs}
    cpu = {k: [] for k in configs}
    optimizer = {k: [] for k in configs}  # the engine's optimiser phase (step.times)
    gw, gc = [], []
    load0 = load()
    for r in range(repeats):
        t = gemm_seconds(gemm_n)
        gw.append(t.wall), gc.append(t.cpu)
        for k, f in configs.items():
            with Timer() as t:
                f()
            wall[k].append(t.wall), cpu[k].append(t.cpu)
            if "optimizer" in getattr(f, "times", {}):
                optimizer[k].append(f.times["optimizer"])
    gemm_w = gemm_flops(gemm_n) / median(gw)
    gemm_c = gemm_flops(gemm_n) / (median(gc) / threads)
    out = {"grid": grid, "batch": batch, "threads": threads, "repeats": repeats,
           "flops_per_step": flops, "gemm_n": gemm_n, "gemm_gflops": gemm_w / 1e9,
           "gemm_gflops_cpu": gemm_c / 1e9, "loadavg_before": load0, "loadavg_after": load(),
           "configs": {}}
    for k in configs:
        w, c = median(wall[k]), median(cpu[k])
        out["configs"][k] = {
            "step_s": w, "cpu_s": c, "samples_per_s": batch / w,
            "gflops": flops / w / 1e9, "gemm_ratio": flops / w / gemm_w,
            # CPU-time based: the work rate while the process actually ran (load-robust at 1 thread)
            "gemm_ratio_cpu": flops / (c / threads) / gemm_c, "step_s_all": wall[k],
            "optimizer_s": median(optimizer[k]) if optimizer[k] else None}
    base_w = out["configs"]["plain"]["step_s"]
    base_c = out["configs"]["plain"]["cpu_s"]
    for k, v in out["configs"].items():
        v["speedup_vs_plain"] = base_w / v["step_s"]
        v["speedup_vs_plain_cpu"] = base_c / v["cpu_s"]
    for precision, seconds in compile_s.items():
        out["compile_seconds" + ("" if precision == "fp32" else "_bf16")] = seconds
    log(f"  step {grid}^2 b{batch} t{threads}: " + ", ".join(
        f"{k} {v['step_s'] * 1e3:.0f} ms ({v['gemm_ratio']:.0%} GEMM)"
        for k, v in out["configs"].items()) + f"; GEMM {out['gemm_gflops']:.1f} GF/s; load {load()[0]}")
    return out


def profile_step(grid, batch, threads, rows=12, generator="unet", problem="burgers",
                 channels_last=True):
    """torch.profiler's top ops (self CPU time) of one deepfusion step: what limits the rate."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(threads)
    prob, model = build(problem, grid, generator, channels_last=channels_last)
    x = inputs(prob, batch)
    step = make_deepfusion(prob, model, x, channels_last=channels_last)
    step()
    with profile(activities=[ProfilerActivity.CPU]) as p:
        step()
    ev = sorted(p.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ev) or 1.0
    return {"grid": grid, "batch": batch, "threads": threads, "channels_last": channels_last,
            "top_ops": [{"op": e.key, "self_ms": e.self_cpu_time_total / 1e3,
                         "share": e.self_cpu_time_total / total, "calls": e.count}
                        for e in ev[:rows]]}


def run(grids=((64, 16), (256, 2)), threads=(1, 2), repeats=5, compile_=False, profile=True,
        bf16=False, log=print) -> dict:
    from deepfusion.engine.parallel.layout import bf16_supported

    out = {"runs": [], "bf16_native": bf16_supported()}
    if bf16 and not out["bf16_native"]:  # training refuses this; the bench measures why
        log("  this CPU has no avx512_bf16/amx_bf16: the bf16 rows time PyTorch's fallback")
    for t in threads:
        for g, b in grids:
            out["runs"].append(bench_grid(g, b, t, repeats, compile_=compile_, bf16=bf16, log=log))
    if profile:
        g, b = grids[-1]
        out["profile"] = profile_step(g, b, 1)
        # Which layout's kernels are slower depends on the CPU (AVX2: NHWC backward convolutions)
        out["profile_nchw"] = profile_step(g, b, 1, channels_last=False)
    return out


def parse_grids(text: str):
    return tuple(tuple(int(v) for v in item.split(":")) for item in text.split(","))


def parse_threads(text: str) -> tuple[int, ...]:
    """"1,2" -> (1, 2): the thread counts of --threads."""
    return tuple(int(t) for t in text.split(","))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grids", default="64:16,256:2", help="GRID:GLOBAL_BATCH,...")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--bf16", action="store_true", help="also time train.precision = bf16")
    p.add_argument("--out")
    a = p.parse_args(argv)
    if a.compile and a.out:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                              os.path.join(os.path.dirname(os.path.abspath(a.out)), "inductor_cache"))
    res = run(parse_grids(a.grids), parse_threads(a.threads), a.repeats,
              compile_=a.compile, bf16=a.bf16)
    emit_json(res, a.out)


if __name__ == "__main__":
    sys.exit(main())
