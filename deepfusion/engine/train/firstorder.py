"""Adam, SGD (momentum) and LAMB as plain foreach updates (Adam in ATen's fused kernel where it
has one), with torch.optim's state-dict layout.

Why not ``torch.optim.Adam``: every ``torch.optim`` optimiser imports ``torch._dynamo`` on its
first ``add_param_group`` and ``step``, a start-up cost of the order of ``import torch``
itself, and every rank of every launch pays it (measured: lab/notes/readme-second-release.md).
Adam and SGD keep torch's update rules (torch's defaults: no amsgrad, no nesterov, dampening 0,
L2 weight decay added to the gradient) and the same ``state_dict`` layout ({"state": {i:
{...}}, "param_groups": [{..., "params": [i, ...]}]}), so checkpoints written with either load
in the other; tested against torch.optim step by step (tests/test_firstorder.py).

LAMB (torch has none) is Adam's moments with a per-tensor trust ratio, for large global
batches; its state has Adam's keys. It is tested against a per-tensor reference written out in
tests/test_firstorder.py. Every update here is a deterministic function of the parameters and
the (all-reduced, identical on every rank) gradients, so all ranks take the same step.
"""
from __future__ import annotations

import math

import torch


class _Plain:
    """A parameter group of hyper-parameters, per-parameter state, state_dict round trip."""

    defaults: dict = {}

    def __init__(self, params, **hyper):
        self.params = list(params)
        self.param_groups = [{**self.defaults, **hyper, "params": self.params}]
        self.state: dict = {}

    def _gradients(self, l2: bool = True):
        """(the group, the parameters with a gradient, their gradients + L2 weight decay unless
        ``l2`` is false: an optimiser that decays the weights in its update)."""
        g = self.param_groups[0]
        params = [p for p in self.params if p.grad is not None]
        grads = [p.grad for p in params]
        if params and l2 and g["weight_decay"]:
            grads = torch._foreach_add(grads, params, alpha=g["weight_decay"])
        return g, params, grads

    def state_dict(self) -> dict:
        index = {id(p): i for i, p in enumerate(self.params)}
        state = {index[id(p)]: dict(s) for p, s in self.state.items()}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [index[id(p)] for p in g["params"]]} for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, sd: dict) -> None:
        (group,) = sd["param_groups"]
        if len(group["params"]) != len(self.params):
            raise ValueError(f"optimizer state holds {len(group['params'])} parameters, the "
                             f"model has {len(self.params)}")
        self.param_groups[0].update({k: v for k, v in group.items() if k != "params"})
        self.state = {}
        for i, s in sd["state"].items():
            p = self.params[int(i)]
            self.state[p] = {k: (v.to(p.dtype if k != "step" else v.dtype, copy=True)
                                 if torch.is_tensor(v) else v) for k, v in s.items()}


def _adam_state(state: dict, params: list) -> list[dict]:
    """Each parameter's Adam state (step count, first and second moments), created at zero
    with the parameter's strides on its first step."""
    for p in params:
        if p not in state:
            state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p)}
    return [state[p] for p in params]


def _adam_moments(state: dict, g: dict, params: list, grads: list):
    """Advance Adam's moments in ``state`` by ``grads``: (first moments m, sqrt(v_hat) + eps,
    the first moment's bias correction c1 = 1 - beta1^n), so m_hat / (sqrt(v_hat) + eps) is
    m / denom / c1."""
    st = _adam_state(state, params)
    beta1, beta2 = g["betas"]
    m, v = [s["exp_avg"] for s in st], [s["exp_avg_sq"] for s in st]
    torch._foreach_add_([s["step"] for s in st], 1.0)
    torch._foreach_lerp_(m, grads, 1 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, grads, grads, 1 - beta2)
    # one step count for all (they are created and stepped together)
    n = float(st[0]["step"])
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, math.sqrt(1 - beta2 ** n))
    torch._foreach_add_(denom, g["eps"])
    return m, denom, 1 - beta1 ** n


# ATen's fused Adam kernel (what torch.optim.Adam(fused=True) calls): one pass over each
# parameter's elements instead of a foreach kernel per operation, a few times less time in the
# optimiser on CPU (bench.roofline, phase ``optimiser``). The same update up to rounding.
FUSED_ADAM = getattr(torch, "_fused_adam_", None)
FUSED_DTYPES = (torch.float32, torch.float64)


class Adam(_Plain):
    """torch.optim.Adam's update (Kingma and Ba, bias-corrected): ATen's fused kernel for
    float32 / float64 CPU parameters, foreach otherwise."""

    defaults = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                "amsgrad": False, "maximize": False, "foreach": True, "capturable": False,
                "differentiable": False, "fused": None, "decoupled_weight_decay": False}

    @torch.no_grad()
    def step(self) -> None:
        g, params, grads = self._gradients()
        if not params:
            return
        if FUSED_ADAM is not None and all(p.device.type == "cpu" and p.dtype in FUSED_DTYPES
                                          for p in params):
            self._fused_step(g, params, grads)
            return
        m, denom, c1 = _adam_moments(self.state, g, params, grads)
        torch._foreach_addcdiv_(params, m, denom, -g["lr"] / c1)

    def _fused_step(self, g: dict, params: list, grads: list) -> None:
        """The step in ATen's fused kernel: the L2 decay is already in ``grads``; the kernel
        pairs elements by memory order, and the moments share each parameter's strides
        (zeros_like), as its gradient does (a view with the parameter's strides)."""
        st = _adam_state(self.state, params)
        steps = [s["step"] for s in st]
        torch._foreach_add_(steps, 1.0)
        beta1, beta2 = g["betas"]
        FUSED_ADAM(params, grads, [s["exp_avg"] for s in st], [s["exp_avg_sq"] for s in st], [],
                   steps, lr=g["lr"], beta1=beta1, beta2=beta2, weight_decay=0.0,
                   eps=g["eps"], amsgrad=False, maximize=False)


class Lamb(_Plain):
    """LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76
    minutes", Algorithm 2), foreach. The variant: Adam's bias-corrected moments, the update
    r = m_hat / (sqrt(v_hat) + eps) + weight_decay * p (decoupled weight decay, inside the
    update, never added to the gradient), and per parameter tensor the trust ratio
    phi = ||p|| / ||r|| (1 when either norm is 0; the paper's scaling function of ||p|| is the
    identity: no clamping), so p -= lr * phi * r moves each tensor by lr * ||p|| per step.
    Every tensor is adapted, biases and norm weights included; a zero tensor (a bias at
    initialisation) takes the plain step lr * r. eps = 1e-6 as in the paper's experiments.
    State: Adam's ("step", "exp_avg", "exp_avg_sq")."""

    defaults = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.0}

    @torch.no_grad()
    def step(self) -> None:
        g, params, grads = self._gradients(l2=False)
        if not params:
            return
        m, denom, c1 = _adam_moments(self.state, g, params, grads)
        r = torch._foreach_div(m, denom)
        torch._foreach_div_(r, c1)
        if g["weight_decay"]:
            torch._foreach_add_(r, params, alpha=g["weight_decay"])
        # the norms as Python floats: one list of step scales, the same on every rank
        pn = torch.stack(torch._foreach_norm(params)).tolist()
        rn = torch.stack(torch._foreach_norm(r)).tolist()
        lr = g["lr"]
        torch._foreach_mul_(r, [-lr * a / b if a > 0 and b > 0 else -lr
                                for a, b in zip(pn, rn)])
        torch._foreach_add_(params, r)


class SGD(_Plain):
    """torch.optim.SGD's update with momentum (dampening 0, no nesterov), foreach."""

    defaults = {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0,
                "nesterov": False, "maximize": False, "foreach": True, "differentiable": False,
                "fused": None}

    @torch.no_grad()
    def step(self) -> None:
        g, params, grads = self._gradients()
        if not params:
            return
        if g["momentum"]:
            for p, d in zip(params, grads):
                buf = self.state.setdefault(p, {}).get("momentum_buffer")
                if buf is None:
                    self.state[p]["momentum_buffer"] = d.detach().clone()
                else:
                    buf.mul_(g["momentum"]).add_(d)
            grads = [self.state[p]["momentum_buffer"] for p in params]
        torch._foreach_add_(params, grads, alpha=-g["lr"])
