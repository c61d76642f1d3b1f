"""Under mpiexec -n P: the allreduced data-parallel gradient equals the single-process gradient
over the whole global batch (float64). Prints OK per variant on rank 0; raises (non-zero exit)
otherwise.

Arguments: the variants to check, in one launch (each a fresh pair of models), each a
"+"-joined set of flags, "plain" for none: overlap (buckets reduced during backward), micro
(micro-batches of 1), channels-last (both models in torch.channels_last and
LossAndGrad(channels_last=True), the default [model] channels_last = true path; the script also
checks that the NHWC instance norm ran and that the 4-D gradients kept the channels_last
layout). One launch for several variants: each launch costs ~2 s of imports per rank."""
import sys

import torch

from deepfusion.config import ParallelConfig
from deepfusion.engine.parallel.comm import SerialComm, world
from deepfusion.engine.parallel.data import ShardedPool
from deepfusion.engine.parallel.parallelize import parallelize
from deepfusion.engine.train.step import LossAndGrad
from diffnet.generators import InstanceNorm, build_generator
from diffnet.problems import get_problem

comm = world()
torch.set_num_threads(1)
task = get_problem("burgers", grid=(16, 16))
global_batch = 8


def make_model(seed, channels_last):
    torch.manual_seed(seed)
    model = build_generator("unet", in_channels=len(task.input_channels), depth=2, base_width=4).double()
    return model.to(memory_format=torch.channels_last) if channels_last else model


def norm_paths(model):
    """Record, per forward of every InstanceNorm, which autograd function produced its output."""
    seen = []
    for m in model.modules():
        if isinstance(m, InstanceNorm):
            m.register_forward_hook(lambda mod, inp, out: seen.append(type(out.grad_fn).__name__))
    return seen


def check_layout(model, seen, channels_last):
    """Under channels-last: every norm took the NHWC kernel and every 4-D weight with a
    spatial kernel, and its gradient (a view into a flat bucket), is channels_last."""
    if not channels_last:
        return
    assert seen and all(name.startswith("InstanceNormNHWC") for name in seen), seen
    convs = [p for p in model.parameters() if p.dim() == 4 and p.shape[-1] > 1 and p.shape[1] > 1]
    assert convs
    for p in convs:
        assert not p.is_contiguous() and p.is_contiguous(memory_format=torch.channels_last)
        assert p.grad.stride() == p.stride(), (p.shape, p.grad.stride(), p.stride())


def check(variant: str) -> None:
    flags = set(variant.split("+")) - {"plain"}
    assert flags <= {"overlap", "micro", "channels-last"}, f"unknown flags {flags}"
    overlap, channels_last = "overlap" in flags, "channels-last" in flags
    # Each rank initialises differently on purpose: the broadcast must make them equal.
    model = make_model(comm.rank, channels_last)
    seen = norm_paths(model)
    pool = ShardedPool(32, global_batch, comm.rank, comm.size, seed=3)
    x_local = task.build_input(task.sample_params(3, pool.local_indices(0, 1)), dtype=torch.float64)
    # small buckets: several of them
    pmodel = parallelize(model, comm, ParallelConfig(bucket_mb=0.01, overlap=overlap))
    dist = LossAndGrad(pmodel, task, global_batch=global_batch, term_names=task.loss_term_names,
                       micro_batch=1 if "micro" in flags else 0,
                       channels_last=channels_last)(x_local)
    check_layout(model, seen, channels_last)

    ref_model = make_model(0, channels_last)
    ref_seen = norm_paths(ref_model)
    ref_pmodel = parallelize(ref_model, SerialComm(), ParallelConfig())
    x_all = task.build_input(task.sample_params(3, pool.global_indices(0, 1)), dtype=torch.float64)
    ref = LossAndGrad(ref_pmodel, task, global_batch=global_batch,
                      term_names=task.loss_term_names, channels_last=channels_last)(x_all)
    check_layout(ref_model, ref_seen, channels_last)

    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-13)
    assert abs(dist.loss - ref.loss) <= 1e-12 * abs(ref.loss), (dist.loss, ref.loss)
    assert abs(dist.grad_norm - ref.grad_norm) <= 1e-10 * ref.grad_norm
    if comm.rank == 0:
        print(f"OK P={comm.size} variant={variant} channels_last={channels_last} "
              f"loss={dist.loss:.15e} grad_norm={dist.grad_norm:.15e}", flush=True)


for v in sys.argv[1:] or ["plain"]:
    check(v)
