"""Under mpiexec -n P: the allreduced data-parallel gradient equals the single-process gradient
over the whole global batch (float64). Prints OK on rank 0; raises (non-zero exit) otherwise."""
import sys

import torch

from deepfusion.comm import SerialComm, world
from deepfusion.data import ShardedPool
from deepfusion.gradsync import GradSync
from deepfusion.step import LossAndGrad, broadcast_module
from diffnet.generators import build_generator
from diffnet.problems import get_problem

overlap = "--overlap" in sys.argv
comm = world()
torch.set_num_threads(1)
task = get_problem("burgers", grid=(16, 16))
global_batch = 8


def make_model(seed):
    torch.manual_seed(seed)
    return build_generator("unet", in_channels=len(task.input_channels), depth=2, base_width=4).double()


# Each rank initialises differently on purpose: the broadcast must make them equal.
model = make_model(comm.rank)
broadcast_module(model, comm)
pool = ShardedPool(32, global_batch, comm.rank, comm.size, seed=3)
x_local = task.build_input(task.sample_params(3, pool.local_indices(0, 1)), dtype=torch.float64)
gs = GradSync(model, comm, bucket_mb=0.01, overlap=overlap)  # small buckets: several of them
dist = LossAndGrad(model, task, comm, gs, global_batch=global_batch, term_names=("pde", "bc"),
                   micro_batch=1 if "--micro" in sys.argv else 0, channels_last=False)(x_local)

ref_model = make_model(0)
ref_gs = GradSync(ref_model, SerialComm())
x_all = task.build_input(task.sample_params(3, pool.global_indices(0, 1)), dtype=torch.float64)
ref = LossAndGrad(ref_model, task, SerialComm(), ref_gs, global_batch=global_batch,
                  term_names=("pde", "bc"), channels_last=False)(x_all)

for a, b in zip(model.parameters(), ref_model.parameters()):
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-13)
assert abs(dist.loss - ref.loss) <= 1e-12 * abs(ref.loss), (dist.loss, ref.loss)
assert abs(dist.grad_norm - ref.grad_norm) <= 1e-10 * ref.grad_norm
if comm.rank == 0:
    print(f"OK P={comm.size} loss={dist.loss:.15e} grad_norm={dist.grad_norm:.15e}")
