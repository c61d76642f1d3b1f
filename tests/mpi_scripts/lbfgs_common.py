"""Shared pieces of the L-BFGS tests: a convex task with a known minimiser, and builders."""
from __future__ import annotations

import numpy as np
import torch

from deepfusion.config import ParallelConfig
from deepfusion.engine.train.lbfgs import LBFGSStepper
from deepfusion.engine.parallel.parallelize import parallelize
from deepfusion.engine.train.step import LossAndGrad


class LinearLSQ:
    """Convex task: the model is a 1x1 convolution u = w . x + b (C+1 parameters); the loss is
    a weighted least-squares fit of a fixed nonlinear target t(x) = sin(3 x0) + x1^2 - x0 x1
    (interior mean + boundary mean, both per sample). Minimiser: the normal equations."""

    name = "linear_lsq"
    C, H, W = 2, 8, 8

    def sample_params(self, seed, indices):
        return np.stack([np.random.default_rng([seed, int(i)]).uniform(-1, 1, size=2)
                         for i in indices])

    def build_input(self, params, dtype=torch.float64):
        yy, xx = np.meshgrid(np.linspace(0, 1, self.H), np.linspace(0, 1, self.W), indexing="ij")
        out = np.stack([np.stack([p[0] * np.cos(2 * xx + p[1]), p[1] * yy + p[0] * xx])
                        for p in params])
        return torch.tensor(out, dtype=dtype)

    @staticmethod
    def target(x):
        return torch.sin(3 * x[:, 0]) + x[:, 1] ** 2 - x[:, 0] * x[:, 1]

    def mask(self, dtype):
        m = torch.zeros(self.H, self.W, dtype=dtype)
        m[0], m[-1], m[:, 0], m[:, -1] = 1, 1, 1, 1
        return m

    def answer(self, u, x):
        return u

    def loss_terms(self, u, x):
        r2 = (u[:, 0] - self.target(x)) ** 2
        m = self.mask(r2.dtype)
        return {"pde": r2.mean(dim=(1, 2)), "bc": (r2 * m).sum(dim=(1, 2)) / m.sum()}

    def minimiser(self, x_all: torch.Tensor) -> np.ndarray:
        """[w0, w1, b] minimising the mean over samples of the loss (float64 normal equations)."""
        x = x_all.double()
        m = self.mask(torch.float64)
        wpix = 1.0 / (self.H * self.W) + m / m.sum()            # (H, W) pixel weights
        feats = torch.stack([x[:, 0], x[:, 1], torch.ones_like(x[:, 0])], -1).reshape(-1, 3)
        wts = wpix.expand(x.shape[0], -1, -1).reshape(-1)
        t = self.target(x).reshape(-1)
        A = feats.T @ (feats * wts[:, None])
        rhs = feats.T @ (wts * t)
        return torch.linalg.solve(A, rhs).numpy()


def linear_model(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return torch.nn.Conv2d(2, 1, 1).to(dtype)


def make_engine(model, task, comm, *, global_batch, micro_batch=0, cfg=None, overlap=False,
                channels_last=False):
    """(gradient buckets, loss-and-gradient, torch optimiser, L-BFGS stepper) for ``model`` on ``comm``
    (parameters broadcast from rank 0)."""
    pm = parallelize(model, comm, ParallelConfig(bucket_mb=0.01, overlap=overlap))
    lg = LossAndGrad(pm, task, global_batch=global_batch, term_names=("pde", "bc"),
                     micro_batch=micro_batch, channels_last=channels_last)
    stepper = LBFGSStepper(model.parameters(), cfg or lbfgs_cfg(), lg)
    return pm.grads, lg, stepper.optimizer, stepper


class _Cfg:
    pass


def lbfgs_cfg(history=10, max_iter=4, tol_grad=1e-12, tol_change=1e-14, line_search="strong_wolfe"):
    c = _Cfg()
    c.name = "lbfgs"
    c.lbfgs_history, c.lbfgs_max_iter = history, max_iter
    c.lbfgs_tolerance_grad, c.lbfgs_tolerance_change = tol_grad, tol_change
    c.lbfgs_line_search = line_search
    c.switch_to_lbfgs_epoch = -1
    return c


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
