"""A split grid emulated in one process, and the check that a problem's losses split exactly.

Owns the part of the problem checker (:mod:`diffnet.problems.check.problem`) that needs blocks of a
split grid without MPI. ``ThreadBlock`` is a :class:`diffnet.domain.Block` whose blocks run in
threads of this process, like ranks: a collective posts the caller's tensor, waits at a barrier
for every block and builds its result from all the posted tensors by differentiable slicing and
concatenation (halo: the window of ``F.pad`` of the assembled global field). Every block
computes on views of the SAME global autograd leaf, so summing the blocks' terms and
backpropagating once carries the gradient across the blocks exactly as the collectives' adjoint
exchange would. :func:`compare_split` then states whether the blocks' answer is the undivided
one and, per term, whether the sum over the blocks equals the undivided term, value and
gradient (the contract of "Domain parallelism" in :mod:`diffnet.problems.contract.loss`).
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import torch

from diffnet.domain import Block, check_split

# Float64 agreement of a split sum with the undivided one: the blocks add the same numbers in
# another order, so they agree to rounding, far inside these bounds; a term computed the wrong
# way on a block (a mean over the block's nodes, a boundary counted twice) is off by O(1).
RTOL, ATOL = 1e-9, 1e-13
# A barrier wait longer than this means a block skipped a collective the others made.
BARRIER_TIMEOUT = 30


class ThreadSplit:
    """The blocks of one split of ``grid`` (``split[a]`` equal parts on axis a), each to be
    driven by its own thread (:func:`run_blocks`)."""

    def __init__(self, grid, split):
        check_split(grid, split)
        self.grid, self.split = tuple(grid), tuple(split)
        self.coords = list(itertools.product(*(range(s) for s in split)))
        self.barrier = threading.Barrier(len(self.coords), timeout=BARRIER_TIMEOUT)
        self.posted: dict = {}

    def blocks(self) -> list["ThreadBlock"]:
        return [ThreadBlock(self, c) for c in self.coords]

    def assemble(self, pieces: dict, lead: int) -> torch.Tensor:
        """The global tensor from the blocks' pieces keyed by block coordinate (grid axes after
        ``lead`` dims)."""
        def rec(prefix):
            a = len(prefix)
            if a == len(self.split):
                return pieces[prefix]
            return torch.cat([rec(prefix + (i,)) for i in range(self.split[a])], dim=lead + a)
        return rec(())


class ThreadBlock(Block):
    """One block of a :class:`ThreadSplit`; its collectives meet the other blocks' threads."""

    def __init__(self, split: ThreadSplit, coord):
        shape = tuple(g // s for g, s in zip(split.grid, split.split))
        super().__init__(split.grid, tuple(c * n for c, n in zip(coord, shape)), shape)
        # one counter per block, shared with its coarse copies (``at_shape``), so that the
        # collectives of a block and of its copies take consecutive keys
        self.group, self.coord, self.calls = split, coord, itertools.count()

    def post_all(self, t: torch.Tensor) -> dict:
        """Post t, wait for every block, return every block's posted tensor by coordinate."""
        key = next(self.calls)
        self.group.posted[key, self.coord] = t
        self.group.barrier.wait()
        return {c: self.group.posted[key, c] for c in self.group.coords}

    def halo(self, x, width=1, fill="zeros"):
        if width > min(self.shape):    # as the MPI block: ghosts from the neighbours' own nodes
            raise ValueError(f"halo width {width} exceeds the block {self.shape}")
        glob = self.group.assemble(self.post_all(x), x.dim() - self.dims)
        p = Block(self.grid).halo(glob, width, fill)
        for a, (s, n) in enumerate(zip(self.start, self.shape)):
            p = p.narrow(x.dim() - self.dims + a, s, n + 2 * width)
        return p

    def sum(self, t):
        pieces = self.post_all(t)
        return sum(pieces[c] for c in self.group.coords)

    def gather(self, t, axis):
        pieces = self.post_all(t)
        line = [c for c in self.group.coords
                if all(c[b] == self.coord[b] for b in range(self.dims) if b != axis)]
        return torch.cat([pieces[c] for c in sorted(line, key=lambda c: c[axis])], dim=-1)


def run_blocks(split: ThreadSplit, work):
    """``work(block)`` on every block, each in its own thread; (blocks, results) in block
    order. An exception on one block ends the others at their next collective and is raised."""
    blocks = split.blocks()
    results, errors = [None] * len(blocks), []

    def run(i):
        try:
            results[i] = work(blocks[i])
        except BaseException as e:                 # noqa: BLE001 -- re-raised below
            errors.append(e)
            split.barrier.abort()                  # the others fail fast, not at the timeout

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(blocks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    own = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if own:
        raise own[0]
    if errors:
        raise RuntimeError(f"the blocks waited {BARRIER_TIMEOUT} s for each other at a "
                           f"collective (halo, sum, gather): every block must make the same "
                           f"collectives in the same order, whatever it holds")
    return blocks, results


# -- the terms and their gradients, undivided and split ---------------------------------------
def terms_and_grads(terms: dict, raw: torch.Tensor) -> dict:
    """Per term: (value (B,), d(sum of the term over the batch)/d raw)."""
    out = {}
    for k, v in terms.items():
        grad = (torch.autograd.grad(v.sum(), raw, retain_graph=True)[0] if v.requires_grad
                else torch.zeros_like(raw))
        out[k] = (v.detach(), grad)
    return out


def undivided(problem, raw: torch.Tensor, x: torch.Tensor, progress: float = 0.25):
    """(answer field, {term: (value, gradient)}) of ``problem`` on the whole grid."""
    problem.set_progress(progress)
    u = problem.answer(raw, x)
    return u.detach(), terms_and_grads(problem.loss_terms(u, x), raw)


def split_run(make, split, raw: torch.Tensor, x: torch.Tensor, progress: float = 0.25):
    """(answer field assembled from the blocks, {term: (sum over the blocks, its gradient)}):
    a fresh ``make()`` on every block of ``split``. ValueError from ``on_block``: the problem
    refuses that split."""
    ts = ThreadSplit(raw.shape[2:], split)

    def work(blk):
        p = make().on_block(blk)
        p.set_progress(progress)
        u = p.answer(blk.local(raw), blk.local(x))
        return u, p.loss_terms(u, blk.local(x))

    blocks, results = run_blocks(ts, work)
    u = ts.assemble({b.coord: r[0] for b, r in zip(blocks, results)}, 2)
    total = {k: sum(r[1][k] for r in results) for k in results[0][1]}
    return u.detach(), terms_and_grads(total, raw)


@dataclass(kw_only=True)
class SplitMismatch:
    """What differs between the split and the undivided computation: the method at fault, and
    what it returned against what was expected."""

    method: str
    got: str
    expected: str


def close(a: torch.Tensor, b: torch.Tensor, rtol: float = RTOL, atol: float = ATOL) -> bool:
    """|a - b| <= rtol * max|b| + atol everywhere (the scale of the whole tensor: a term near
    zero for one sample is compared at the batch's scale)."""
    scale = b.abs().max().item() if b.numel() else 0.0
    return a.shape == b.shape and bool(((a - b).abs() <= rtol * scale + atol).all())


def compare_split(ref_u, ref, got_u, got, n_blocks: int, exact_impose: bool = True,
                  rtol: float = RTOL, atol: float = ATOL):
    """The first :class:`SplitMismatch` between the undivided (``ref_u``, ``ref``) and the
    split (``got_u``, ``got``) results, or None when they agree.

    ``exact_impose``: the blocks' answer field must equal the undivided one bit for bit (a
    pointwise impose and the Plain head); otherwise to rounding (a global reduction in the
    answer head sums in another order). ``rtol`` and ``atol``: see :func:`close`."""
    same_u = torch.equal(got_u, ref_u) if exact_impose else close(got_u, ref_u, rtol, atol)
    if not same_u:
        err = (got_u - ref_u).abs().max().item() if got_u.shape == ref_u.shape else None
        got = f"a field {tuple(got_u.shape)}"
        return SplitMismatch(
            method="answer (impose, then the answer head)",
            got=got if err is None else f"{got} differing by up to {err:.3g}",
            expected=f"the undivided answer field {tuple(ref_u.shape)}")
    if set(got) != set(ref):
        return SplitMismatch(method="loss_terms", got=f"terms {sorted(got)}",
                             expected=f"the undivided terms {sorted(ref)}")
    for k in ref:
        if not close(got[k][0], ref[k][0], rtol, atol):
            return SplitMismatch(
                method="loss_terms",
                got=f"term {k!r} summed over the {n_blocks} blocks = {fmt(got[k][0])}",
                expected=f"the undivided {fmt(ref[k][0])} (each block returns its PART of a "
                         f"term: a mean divides by the GLOBAL node count, a boundary term "
                         f"counts only on the blocks holding that boundary)")
        g, r = got[k][1], ref[k][1]
        if not close(g, r, rtol, atol):
            err = (g - r).abs().max().item() / (r.abs().max().item() + 1e-300)
            return SplitMismatch(
                method="loss_terms",
                got=f"a gradient of term {k!r} summed over the {n_blocks} blocks that differs "
                    f"from the undivided one by {err:.3g} of its largest entry",
                expected="the undivided gradient (exchange through the block's halo/sum, not "
                         "a fill of the block's own edges)")
    return None


def fmt(t: torch.Tensor) -> str:
    """A (B,) tensor of values, short: [1.234, 5.678e-05]."""
    return "[" + ", ".join(f"{v:.6g}" for v in t.detach().reshape(-1).tolist()[:6]) + \
        (", ...]" if t.numel() > 6 else "]")
