"""Under mpiexec -n P: the allreduced data-parallel gradient equals the single-process gradient
over the whole global batch (float64). Prints OK on rank 0; raises (non-zero exit) otherwise."""
import sys

import torch

from deepfusion.config import ParallelConfig
from deepfusion.engine.comm import SerialComm, world
from deepfusion.engine.data import ShardedPool
from deepfusion.engine.parallel import parallelize
from deepfusion.engine.step import LossAndGrad
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
pool = ShardedPool(32, global_batch, comm.rank, comm.size, seed=3)
x_local = task.build_input(task.sample_params(3, pool.local_indices(0, 1)), dtype=torch.float64)
# small buckets: several of them
pmodel = parallelize(model, comm, ParallelConfig(bucket_mb=0.01, overlap=overlap))
dist = LossAndGrad(pmodel, task, global_batch=global_batch, term_names=task.loss_term_names,
                   micro_batch=1 if "--micro" in sys.argv else 0, channels_last=False)(x_local)

ref_model = make_model(0)
ref_pmodel = parallelize(ref_model, SerialComm(), ParallelConfig())
x_all = task.build_input(task.sample_params(3, pool.global_indices(0, 1)), dtype=torch.float64)
ref = LossAndGrad(ref_pmodel, task, global_batch=global_batch,
                  term_names=task.loss_term_names, channels_last=False)(x_all)

for a, b in zip(model.parameters(), ref_model.parameters()):
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-13)
assert abs(dist.loss - ref.loss) <= 1e-12 * abs(ref.loss), (dist.loss, ref.loss)
assert abs(dist.grad_norm - ref.grad_norm) <= 1e-10 * ref.grad_norm
if comm.rank == 0:
    print(f"OK P={comm.size} loss={dist.loss:.15e} grad_norm={dist.grad_norm:.15e}")
