"""Under mpiexec -n P: data-parallel L-BFGS (float64) takes the same iterates as L-BFGS on one
process over the whole global batch; all ranks hold bit-identical parameters; a checkpointed
and reloaded L-BFGS continues bit-for-bit; on a convex problem it reaches the known minimiser.
Prints OK lines on rank 0 per variant; any failure on any rank ends every rank (non-zero exit).

    mpiexec -n 2 python tests/mpi_scripts/lbfgs_iterates.py VARIANT...

Each VARIANT is a "+"-joined set of flags, "plain" for none: micro (lazy micro-batches of 2),
overlap (buckets reduced during backward), channels-last. Several variants share one launch
(each launch costs every rank ~2 s of imports).
"""
import hashlib
import os
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lbfgs_common import LinearLSQ, flat_params, lbfgs_cfg, linear_model, make_engine  # noqa: E402

from deepfusion.engine.checkpoint import store as ckpt  # noqa: E402
from deepfusion.engine.parallel.comm import SerialComm, world  # noqa: E402
from deepfusion.engine.parallel.data import ShardedPool  # noqa: E402
from deepfusion.engine.parallel.data import LazyBatch  # noqa: E402
from diffnet.generators import build_generator  # noqa: E402
from diffnet.problems import get_problem  # noqa: E402
from tests.mpi_scripts.cases import run_cases  # noqa: E402

comm = world()
torch.set_num_threads(1)
GB, STEPS = 8, 4
task = get_problem("burgers", grid=(16, 16))


def same_on_all_ranks(model, what):
    h = hashlib.sha256(flat_params(model).numpy().tobytes()).hexdigest()
    hs = comm.allgather_obj(h)
    assert len(set(hs)) == 1, f"{what}: parameters differ across ranks: {hs}"


class Variant:
    """The flags of one variant and the batches it trains on."""

    def __init__(self, name: str):
        flags = set(name.split("+")) - {"plain"}
        assert flags <= {"micro", "overlap", "channels-last"}, f"unknown flags {flags}"
        self.name = name
        self.micro = 2 if "micro" in flags else 0
        self.overlap, self.cl = "overlap" in flags, "channels-last" in flags
        self.pool = ShardedPool(32, GB, comm.rank, comm.size, seed=3)

    def unet(self, seed):
        torch.manual_seed(seed)
        m = build_generator("unet", in_channels=len(task.input_channels), depth=2,
                            base_width=4).double()
        return m.to(memory_format=torch.channels_last) if self.cl else m

    def engine(self, model, cfg):
        return make_engine(model, task, comm, global_batch=GB, micro_batch=self.micro, cfg=cfg,
                           overlap=self.overlap, channels_last=self.cl)

    def local_batch(self, s):
        idx = self.pool.local_indices(0, s)
        if self.micro:  # inputs built lazily per micro-batch, as the trainer does for big batches
            return LazyBatch(lambda i: task.build_input(task.sample_params(3, i),
                                                        dtype=torch.float64), idx, self.micro)
        return task.build_input(task.sample_params(3, idx), dtype=torch.float64)

    def global_batch(self, s):
        return task.build_input(task.sample_params(3, self.pool.global_indices(0, s)),
                                dtype=torch.float64)


def iterates(v: Variant) -> None:
    """1. a DiffNet generator on Burgers: P ranks against one process; 2. a fresh model and
    optimiser resumed from the step-2 checkpoint continue bit for bit."""
    cfg = lbfgs_cfg(history=5, max_iter=3)
    model = v.unet(comm.rank)  # different on purpose: parallelize's broadcast makes them equal
    _, _, opt, stepper = v.engine(model, cfg)
    ref = v.unet(0)
    _, _, _, rstepper = make_engine(ref, task, SerialComm(), global_batch=GB, cfg=cfg,
                                    channels_last=v.cl)
    losses = []
    tmp = comm.bcast_obj(tempfile.mkdtemp() if comm.rank == 0 else None)
    path = os.path.join(tmp, "checkpoints", "step_00000002.h5")
    for s in range(STEPS):
        if s == 2:  # checkpoint the L-BFGS state (rank 0 writes), as the trainer does
            if comm.rank == 0:
                ckpt.save_checkpoint(path, model_state=model.state_dict(),
                                     optim_state=opt.state_dict(), rng_state={},
                                     meta={"step": 2, "optimizer": "lbfgs"})
            comm.barrier()
        r = stepper.run(v.local_batch(s))
        rr = rstepper.run(v.global_batch(s))
        assert r.finite and rr.finite
        assert r.metrics["func_evals"] == rr.metrics["func_evals"], (r.metrics, rr.metrics)
        assert abs(r.loss - rr.loss) <= 1e-10 * abs(rr.loss), (s, r.loss, rr.loss)
        torch.testing.assert_close(flat_params(model), flat_params(ref), rtol=1e-8, atol=1e-11)
        same_on_all_ranks(model, f"step {s}")
        losses.append(r.loss)
    assert losses[-1] < losses[0], losses

    state = ckpt.load_checkpoint(path)
    model2 = v.unet(123)
    model2.load_state_dict(state["model_state"])
    _, _, opt2, stepper2 = v.engine(model2, cfg)
    opt2.load_state_dict(state["optim_state"])
    assert len(opt2.state[opt2._params[0]]["old_dirs"]) > 0, "history not restored"
    for s in range(2, STEPS):
        stepper2.run(v.local_batch(s))
    assert torch.equal(flat_params(model2), flat_params(model)), \
        "resumed L-BFGS left the trajectory"
    same_on_all_ranks(model2, "resumed")
    if comm.rank == 0:
        print(f"OK iterates P={comm.size} variant={v.name} micro={v.micro} overlap={v.overlap} "
              f"channels_last={v.cl} losses={['%.6e' % x for x in losses]}", flush=True)


def convex(v: Variant) -> None:
    """3. a convex problem with a known minimiser."""
    lin = LinearLSQ()
    lpool = ShardedPool(16, 16, comm.rank, comm.size, seed=5)
    xl = lin.build_input(lin.sample_params(5, lpool.local_indices(0, 0)))
    xg = lin.build_input(lin.sample_params(5, lpool.global_indices(0, 0)))
    lm = linear_model(comm.rank)
    _, _, _, lstep = make_engine(lm, lin, comm, global_batch=16, micro_batch=v.micro,
                                 cfg=lbfgs_cfg(history=10, max_iter=20, tol_grad=1e-14,
                                               tol_change=0.0))
    for _ in range(3):
        res = lstep.run(xl)
    w = np.concatenate([lm.weight.detach().reshape(-1).numpy(), lm.bias.detach().numpy()])
    wstar = lin.minimiser(xg)
    # a line search on function values resolves the minimiser to ~sqrt(eps) relative, not eps
    assert np.allclose(w, wstar, rtol=1e-6, atol=1e-8), (w, wstar)
    assert res.grad_norm < 1e-6, res.grad_norm
    same_on_all_ranks(lm, "convex")
    if comm.rank == 0:
        print(f"OK convex P={comm.size} variant={v.name} w={w.tolist()} w*={wstar.tolist()}",
              flush=True)


def run(name: str) -> None:
    v = Variant(name)
    iterates(v)
    convex(v)


if __name__ == "__main__":
    run_cases(comm, run, sys.argv[1:] or ["plain"])
