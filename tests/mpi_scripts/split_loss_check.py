"""Under mpiexec -n P: every problem's loss terms on the blocks of a real MPI domain split
(deepfusion.engine.parallel.halo) against the undivided terms on one process (float64).

Each argument is a case GRIDxSPLIT, e.g. ``16x16:1x2`` or ``8x8x8:1x2x2``: the world is cut into
domain groups of prod(split) ranks; on each, every problem configuration of that dimension is
built on the rank's block (``on_block``), fed the block's parts of the same global raw field and
inputs, and checked: the per-sample terms summed over the group (``block.sum``) equal the
undivided ones, and the gradient of each term w.r.t. the global raw field, summed over the
group, equals the undivided gradient. Rank 0 prints one ``OK ...`` line per case; any failure
aborts the job non-zero with the traceback on stderr.
"""
import sys

import torch

from deepfusion.engine.parallel.comm import world
from tests.mpi_scripts.cases import grid_and_split, report_ok, run_cases
from deepfusion.engine.parallel.halo import domain_groups, make_block
from diffnet.problems import PROBLEMS, get_problem

torch.set_num_threads(1)
WORLD = world()
RTOL, ATOL = 1e-10, 1e-13

# Every registered problem with its default options (never a fixed list of names), and the option
# sets below of the problems that have them.
EXTRA_2D = [("burgers", dict(hard_bc=hb, **kw)) for hb in (False, True) for kw in (
    dict(), dict(form="advective", viscosity=0.02, row_weight=1.0), dict(scheme="upwind",
                                                                          horizon=2),
    dict(scheme="muscl", horizon=2), dict(scheme="lax-oleinik", smoothing=0.1))] + [
    ("poisson", dict()), ("poisson", dict(quadrature="nodes", bc_mode="lift")),
    ("poisson", dict(loss="residual")),
    ("poisson", dict(loss="residual", residual_norm="multilevel")),
    ("poisson", dict(loss="residual", residual_norm="operator", bc_mode="lift")),
    ("reaction_diffusion", dict()),
    ("reaction_diffusion", dict(quadrature="nodes", bc_mode="lift")), ("darcy", dict()),
    ("darcy", dict(ritz=True)), ("reaction_diffusion", dict(ritz=True, bc_mode="lift")),
    ("darcy", dict(ritz=True, ritz_fields=3))]
EXTRA_3D = [("poisson3d", dict(quadrature="nodes", bc_mode="lift")),
            ("poisson3d", dict(loss="residual")),
            ("poisson3d", dict(loss="residual", residual_norm="multilevel")),
            ("poisson3d", dict(loss="residual", residual_norm="operator"))]


def configs(dims, extra):
    """(name, options) of every registered problem of ``dims`` axes, then the extra sets."""
    default = [(n, {}) for n in sorted(PROBLEMS) if PROBLEMS[n].dims == dims]
    return default + [(n, kw) for n, kw in extra if n in PROBLEMS and (n, kw) not in default]


CONFIGS_2D, CONFIGS_3D = configs(2, EXTRA_2D), configs(3, EXTRA_3D)


def data(p, grid, batch=2):
    """The same raw leaf and inputs on every rank (fixed seeds)."""
    p.set_progress(0.25)
    x = p.build_input(p.sample_params(0, range(batch)), dtype=torch.float64)
    g = torch.Generator().manual_seed(7)
    raw = 0.4 + 0.3 * torch.randn((batch, p.output_channels, *grid), generator=g,
                                  dtype=torch.float64)
    return raw.requires_grad_(), x


def term_grads(terms: dict, raw: torch.Tensor) -> dict:
    """d(sum over the batch of each term)/d raw. Each is the gradient of the weighted total with
    the other terms' weights 0, so every rank runs the same backward (the halo's adjoint
    exchange is collective) whichever terms its block holds."""
    out = {}
    for k in terms:
        total = sum((1.0 if j == k else 0.0) * v.sum() for j, v in terms.items())
        out[k] = (torch.autograd.grad(total, raw, retain_graph=True)[0] if total.requires_grad
                  else torch.zeros_like(raw))
    return out


def check(name, kw, grid, block, dom, case):
    make = lambda: get_problem(name, grid=grid, **kw)      # noqa: E731
    plain = make()
    raw, x = data(plain, grid)
    ref = plain.loss_terms(plain.answer(raw, x), x)
    ref_grads = term_grads(ref, raw)

    p = make().on_block(block)
    p.set_progress(0.25)
    xb = block.local(x)
    terms = p.loss_terms(p.answer(block.local(raw), xb), xb)
    grads = term_grads(terms, raw)
    what = f"case={case} {name} {kw}"
    assert terms.keys() == ref.keys(), what
    for k in ref:
        total = block.sum(terms[k].detach().contiguous())
        torch.testing.assert_close(total, ref[k].detach(), rtol=RTOL, atol=ATOL,
                                   msg=f"{what}: term {k}")
        g = grads[k].contiguous()
        dom.allreduce_(g.view(-1))                # the blocks' gradients tile the global field
        scale = ref_grads[k].abs().max().item() + 1e-300
        torch.testing.assert_close(g / scale, ref_grads[k] / scale, rtol=RTOL, atol=RTOL,
                                   msg=f"{what}: gradient of term {k}")


def run(case):
    grid, split = grid_and_split(case)
    dom, _, _, n_groups = domain_groups(WORLD, split)
    block = make_block(dom, grid, split)
    configs = CONFIGS_3D if len(grid) == 3 else CONFIGS_2D
    for name, kw in configs:
        check(name, kw, tuple(grid), block, dom, case)
    report_ok(WORLD, f"case={case} groups={n_groups} block={block.shape} "
              f"configs={len(configs)}")


if __name__ == "__main__":
    run_cases(WORLD, run, sys.argv[1:])
