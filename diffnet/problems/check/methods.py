"""The checks of :mod:`diffnet.problems.check.problem`, one function per check, on a :class:`Subject`.

Each check builds the problem afresh (``Subject.make``), calls its methods on small draws and a
random network output, and either returns a short description of what it verified or raises
:class:`Fault` (the method at fault, what it returned, what was expected) or :class:`Skipped`
(why the check does not apply). A method that raises is a Fault naming it (:func:`call`).
The split against undivided check runs the blocks in threads (:mod:`.check_split`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch

from diffnet.problems.contract.base import Problem
from diffnet.problems.contract.heads import AnswerHead
from diffnet.problems.check.split import ThreadSplit, close, compare_split, fmt, split_run, undivided
from diffnet.problems.contract.derived import mismatches
from diffnet.problems.contract.family import (has_answer_residual, has_derived_channels, has_reference,
                                              solves_from_inputs)
from diffnet.problems.contract.registry import problem_spec

# A batch of 3 draws of seed 11; losses at training progress 0.25 (a schedule's middle).
BATCH, SEED, PROGRESS = 3, 11, 0.25


class Fault(Exception):
    """Raised inside a check: ``method`` returned ``got``; ``expected`` says what it should
    (``raised``: the exception it raised instead)."""

    def __init__(self, method: str, got: str = "", expected: str = "",
                 raised: BaseException | None = None):
        super().__init__(method)
        self.method, self.raised = method, raised
        if raised is not None:
            self.detail = f"raised {type(raised).__name__}: {raised}"
        else:
            self.detail = f"returned {got}" + (f"; expected {expected}" if expected else "")


class Skipped(Exception):
    """Raised inside a check that does not apply; the message says why."""


@dataclass(kw_only=True)
class Subject:
    """The problem under check: its class, on which grid, with which options."""

    cls: type
    label: str
    grid: tuple
    options: dict

    def make(self) -> Problem:
        return self.cls(grid=self.grid, **self.options)


def call(method: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``; an exception becomes a Fault naming ``method``."""
    try:
        return fn(*args, **kwargs)
    except (Fault, Skipped):
        raise
    except NotImplementedError as e:
        raise Skipped(f"{method} is not implemented ({e})" if str(e) else
                      f"{method} is not implemented") from None
    except Exception as e:  # noqa: BLE001 -- the user's method failed: say which and how
        raise Fault(method, raised=e) from None


def expect(ok: bool, method: str, got, expected: str) -> None:
    if not ok:
        raise Fault(method, str(got), expected)


def describe(v) -> str:
    """A short description of a returned value: type, shape and dtype."""
    if isinstance(v, (torch.Tensor, np.ndarray)):
        kind = "tensor" if isinstance(v, torch.Tensor) else "numpy array"
        return f"a {kind} of shape {tuple(v.shape)} and dtype {v.dtype}"
    return f"{type(v).__name__} {v!r}"[:160]


def check_array(method: str, v, kind, shape, dtype) -> None:
    """``v`` is a finite ``kind`` (torch.Tensor or np.ndarray) of ``shape`` and ``dtype``."""
    ok = isinstance(v, kind) and tuple(v.shape) == tuple(shape) and v.dtype == dtype
    noun = "tensor" if kind is torch.Tensor else "numpy array"
    expect(ok, method, describe(v), f"a {noun} of shape {tuple(shape)} and dtype {dtype}")
    finite = torch.isfinite(v).all() if isinstance(v, torch.Tensor) else np.isfinite(v).all()
    expect(bool(finite), method, f"{describe(v)} with non-finite entries", "finite values")


def check_attributes(s: Subject) -> str:
    p = s.make()
    for attr in ("param_names", "input_channels", "loss_only_channels", "loss_term_names",
                 "reference_methods"):
        v = getattr(p, attr, None)
        expect(isinstance(v, tuple) and all(isinstance(c, str) for c in v),
               f"class attribute {attr}", repr(v), "a tuple of names")
    expect(bool(p.name) and isinstance(p.name, str), "class attribute name", repr(p.name),
           "the name the problem is known by")
    expect(bool(p.input_channels), "class attribute input_channels", "()", "a channel name "
           "per channel of build_input")
    stray = [c for c in p.loss_only_channels if c not in p.input_channels]
    expect(not stray, "class attribute loss_only_channels", repr(p.loss_only_channels),
           f"names among input_channels {list(p.input_channels)} (not {stray})")
    names = p.loss_term_names
    expect(bool(names) and len(set(names)) == len(names), "class attribute loss_term_names",
           repr(names), "distinct names of the loss terms")
    if has_reference(p):
        expect(p.reference_methods[:1] == ("auto",), "class attribute reference_methods",
               repr(p.reference_methods), "the methods reference_solution accepts, opening "
                                          "with 'auto'")
    if has_answer_residual(p):
        t = p.residual_threshold
        expect(t is None or (isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0),
               "class attribute residual_threshold", repr(t), "None (each model's threshold "
               "is calibrated on its validation draws) or the answer_residual above which an "
               "answer is flagged when the model has none, a number > 0")
    expect(p.dims == len(s.grid), "class attribute dims", repr(p.dims),
           f"the number of grid axes, {len(s.grid)}")
    expect(isinstance(p.head, AnswerHead) and isinstance(p.head.channels, int)
           and p.head.channels >= 1, "head", repr(p.head), "an AnswerHead of "
           "diffnet.problems.contract.heads (Plain, Ritz or a subclass) with channels >= 1")
    expect(isinstance(p.output_channels, int) and p.output_channels >= 1,
           "output_channels", repr(p.output_channels), "an int >= 1")
    axes = call("axes", lambda: p.axes)
    expect(len(axes) == p.dims and all(a.hi > a.lo for a in axes), "axes", repr(axes),
           f"{p.dims} Axis(name, lo, hi) with hi > lo, one per grid axis (the class attribute "
           f"dims = {p.dims}; a 3-D problem sets dims = 3)")
    return f"{p.dims}-D, inputs {list(p.input_channels)}, terms {list(names)}"


def check_parameters(s: Subject) -> str:
    p = s.make()
    k = len(p.param_names)
    bounds = call("param_bounds", p.param_bounds)
    check_array("param_bounds", bounds, np.ndarray, (k, 2), np.float64)
    expect(bool(np.all(bounds[:, 0] <= bounds[:, 1])), "param_bounds", bounds.tolist(),
           "lo <= hi on every row")
    params = call("sample_params", p.sample_params, SEED, range(BATCH))
    check_array("sample_params", params, np.ndarray, (BATCH, k), np.float64)
    inside = np.all((params >= bounds[:, 0]) & (params <= bounds[:, 1]))
    expect(bool(inside), "sample_params", params.tolist(), f"draws inside param_bounds "
                                                           f"{bounds.tolist()}")
    return f"{k} parameters {list(p.param_names)[:4]}{' ...' if k > 4 else ''}"


def draw(p: Problem, dtype=torch.float64, seed: int = SEED, n: int = BATCH):
    params = call("sample_params", p.sample_params, seed, range(n))
    return params, call("build_input", p.build_input, params, dtype=dtype)


def check_draws(s: Subject) -> str:
    p, q = s.make(), s.make()
    a, xa = draw(p)
    b, xb = draw(q)
    expect(np.array_equal(a, b), "sample_params", f"{a.tolist()} then {b.tolist()} for seed "
                                                  f"{SEED}", "the same draws for the same seed")
    one = call("sample_params", p.sample_params, SEED, [BATCH - 1])
    expect(np.array_equal(one[0], a[-1]), "sample_params",
           f"{one[0].tolist()} for index {BATCH - 1} alone but {a[-1].tolist()} among "
           f"indices 0..{BATCH - 1}", "row j to depend only on (seed, indices[j])")
    expect(torch.equal(xa, xb), "build_input", "different inputs for the same parameters",
           "the same inputs for the same parameters")
    if not p.param_names:
        return "no parameters: every draw is the same problem"
    c, xc = draw(p, seed=SEED + 1)
    expect(not np.array_equal(a, c), "sample_params", f"the same draws for seeds {SEED} and "
                                                      f"{SEED + 1}", "other draws for another seed")
    expect(not torch.equal(xa, xc), "build_input", f"the same inputs for the draws of seeds "
                                                   f"{SEED} and {SEED + 1}", "other inputs")
    return "same seed: same parameters and inputs; another seed: others"


def raw_field(p: Problem, n: int = BATCH, dtype=torch.float64, seed: int = 0) -> torch.Tensor:
    """A network output (n, output_channels, *grid): an offset with noise of either sign."""
    g = torch.Generator().manual_seed(seed + 7)
    raw = 0.4 + 0.3 * torch.randn((n, p.output_channels, *p.grid), generator=g,
                                  dtype=torch.float64)
    return raw.to(dtype).requires_grad_()


def terms_of(p: Problem, raw: torch.Tensor, x: torch.Tensor) -> tuple:
    """(answer field, terms) of ``p`` at ``raw``, each output checked for shape and dtype: the
    imposed fields (one per channel of the answer head), the answer, the terms."""
    n = raw.shape[0]
    v = call("impose", p.impose, raw, x)
    check_array("impose", v, torch.Tensor, (n, p.head.channels, *p.grid), raw.dtype)
    u = call("answer", p.answer, raw, x)
    check_array("answer", u, torch.Tensor, (n, 1, *p.grid), raw.dtype)
    terms = call("loss_terms", p.loss_terms, u, x)
    names = set(p.loss_term_names)
    expect(isinstance(terms, dict) and set(terms) == names, "loss_terms",
           f"keys {sorted(terms) if isinstance(terms, dict) else describe(terms)}",
           f"the keys of loss_term_names {sorted(names)}")
    for k, v in terms.items():
        check_array(f"loss_terms (term {k!r})", v, torch.Tensor, (n,), raw.dtype)
    return u, terms


def shapes_check(dtype_name: str):
    """The check of every output's shape and dtype with inputs and network output of dtype
    ``dtype_name`` ("float32" or "float64")."""
    dtype = getattr(torch, dtype_name)

    def check(s: Subject) -> str:
        p = s.make()
        p.set_progress(PROGRESS)
        _, x = draw(p, dtype)
        check_array("build_input", x, torch.Tensor, (BATCH, len(p.input_channels), *s.grid),
                    dtype)
        raw = raw_field(p, dtype=dtype)
        _, terms = terms_of(p, raw, x)
        total = sum(t.sum() for t in terms.values())
        if total.requires_grad:
            call("loss_terms (backward)", total.backward)
            expect(raw.grad is not None and bool(torch.isfinite(raw.grad).all()),
                   "loss_terms (backward)", "a non-finite gradient", "a finite gradient")
        return (f"inputs {tuple(x.shape)}, answer {(BATCH, 1, *s.grid)}, "
                f"{len(terms)} terms of shape ({BATCH},)")
    return check


def check_fields(s: Subject) -> str:
    p = s.make()
    _, x = draw(p)
    fields = {c: x[:, i].numpy() for i, c in enumerate(p.input_channels)}
    got = call("inputs_from_fields", p.inputs_from_fields, fields)
    check_array("inputs_from_fields", got, np.ndarray, tuple(x.shape), np.float64)
    expect(np.allclose(got, x.numpy(), rtol=1e-12, atol=1e-12), "inputs_from_fields",
           "other inputs than build_input's from build_input's own channels",
           "build_input's inputs back")
    done = f"build_input's channels {list(p.input_channels)} give its inputs back"
    if not has_derived_channels(p):
        return done
    # build_input's own channels must pass the check every prediction from given fields makes
    bad = call("derived_channels", mismatches, p, x.numpy().astype(np.float64))
    expect(not bad, "derived_channels",
           {k: f"differs from build_input's by up to {m['diff']:.3g}" for k, m in bad.items()},
           "build_input's derived channels recomputed from its other channels")
    return f"{done}; its derived channels agree with build_input's"


def check_per_sample(s: Subject) -> str:
    p = s.make()
    p.set_progress(PROGRESS)
    _, x = draw(p)
    raw = raw_field(p).detach()
    u, terms = terms_of(p, raw, x)
    for j in range(BATCH):
        uj, alone = terms_of(p, raw[j:j + 1], x[j:j + 1])
        expect(close(uj, u[j:j + 1], 1e-10, 1e-13), "answer",
               f"another field for sample {j} alone than in a batch of {BATCH}",
               "a sample's field not to depend on the other samples of the batch")
        for k, v in terms.items():
            expect(close(alone[k], v[j:j + 1], 1e-10, 1e-13), f"loss_terms (term {k!r})",
                   f"{fmt(alone[k])} for sample {j} alone but {fmt(v[j:j + 1])} for it in a "
                   f"batch of {BATCH}", "the same: a sample's terms must not depend on the "
                   "other samples of the batch")
    return f"each of {BATCH} samples alone gives its terms in the batch"


def total_loss(p: Problem, raw: torch.Tensor, x: torch.Tensor, leave=()) -> torch.Tensor:
    return sum(t.sum() for k, t in terms_of(p, raw, x)[1].items() if k not in leave)


def check_gradient(s: Subject, directions: int = 3, h: float = 1e-6, rtol: float = 1e-5) -> str:
    """Directional central differences of the total float64 loss against autograd's, without
    the problem's ``detached_terms`` (a stop-gradient makes them differ by design)."""
    p = s.make()
    p.set_progress(PROGRESS)
    leave = tuple(p.detached_terms)
    if set(p.loss_term_names) <= set(leave):
        raise Skipped(f"every loss term is declared detached ({list(leave)}): no gradient "
                      f"to compare with differences")
    _, x = draw(p, n=2)
    raw = raw_field(p, n=2)
    loss = total_loss(p, raw, x, leave)
    if not loss.requires_grad:
        raise Fault("loss_terms", "terms that do not depend on the network output",
                    "terms with a gradient w.r.t. the network output")
    grad = call("loss_terms (backward)", torch.autograd.grad, loss, raw)[0]
    expect(bool(grad.abs().max() > 0), "loss_terms (backward)", "a zero gradient at a random "
           "network output", "a loss that depends on the network output")
    g = torch.Generator().manual_seed(3)
    worst = 0.0
    for _ in range(directions):
        v = torch.randn(raw.shape, generator=g, dtype=torch.float64)
        with torch.no_grad():
            plus = total_loss(p, raw + h * v, x, leave).item()
            minus = total_loss(p, raw - h * v, x, leave).item()
        fd, ad = (plus - minus) / (2 * h), float((grad * v).sum())
        scale = abs(loss.item()) + float((grad * v).abs().sum())
        err = abs(fd - ad) / scale
        worst = max(worst, err)
        expect(err <= rtol, "loss_terms (backward)",
               f"a directional derivative {ad:.8g} from autograd against {fd:.8g} from central "
               f"differences", f"agreement to {rtol:g} of the loss's scale (an operation "
               f"detached from the graph or a custom backward?)")
    left = f" (without the detached terms {list(leave)})" if leave else ""
    return f"{directions} directions agree to {worst:.1e}{left}"


def check_reference_solution(s: Subject) -> str:
    return reference_check(s, "reference_solution", lambda params, x: params)


def check_solve_from_inputs(s: Subject) -> str:
    return reference_check(s, "solve_from_inputs", lambda params, x: x)


def reference_check(s: Subject, method: str, sample) -> str:
    """``method`` of one draw (``sample(params[0], inputs[0])`` its argument) is a finite
    float64 field on the grid."""
    p = s.make()
    if not has_reference(p):
        raise Skipped("no reference solver (reference_solution not defined): it trains and "
                      "infers; solve, compare and the error of evaluate need one")
    if method == "solve_from_inputs" and not solves_from_inputs(p):
        raise Skipped("solve_from_inputs not defined (the reference solver needs parameter "
                      "vectors)")
    params, x = draw(p, n=1)
    ref = call(method, getattr(p, method), sample(params[0], x[0]))
    check_array(method, ref, np.ndarray, s.grid, np.float64)
    return f"{s.grid} float64"


def split_check(split):
    """The check of the terms on the blocks of ``split`` against the undivided terms."""
    def check(s: Subject) -> str:
        try:
            ts = ThreadSplit(s.grid, split)
        except ValueError as e:
            raise Skipped(f"grid {'x'.join(map(str, s.grid))} does not split so: {e}") from None
        try:
            for blk in ts.blocks():
                s.make().on_block(blk)
        except ValueError as e:
            raise Skipped(f"no domain parallelism on this split: {e}") from None
        p = s.make()
        _, x = draw(p, n=2)
        raw = raw_field(p, n=2)
        ref_u, ref = call("answer/loss_terms (undivided)", undivided, p, raw, x, PROGRESS)
        got_u, got = call(f"answer/loss_terms on blocks {split}", split_run, s.make, split,
                          raw, x, PROGRESS)
        bad = compare_split(ref_u, ref, got_u, got, len(ts.coords), exact_impose=False)
        if bad is not None:
            raise Fault(f"{bad.method} on blocks {split}", bad.got, bad.expected)
        return f"{len(ts.coords)} blocks: every term's value and gradient"
    return check


def check_round_trip(s: Subject) -> str:
    p = s.make()
    cfg = call("config", p.config)
    expect(isinstance(cfg, dict), "config", describe(cfg), "a dict of constructor options")
    try:
        meta = json.loads(json.dumps({"name": where(s.cls), "kwargs": cfg}, allow_nan=True))
    except (TypeError, ValueError) as e:
        raise Fault("config", f"{cfg!r}, which is not JSON ({e})",
                    "JSON values (a checkpoint stores config() as JSON)") from None
    from diffnet.problems import option_names

    unknown = sorted(set(cfg) - set(option_names(s.cls)))
    expect(not unknown, "config", f"keys {unknown}", "only the constructor's keyword options")
    # the constructor's options too: a config() that drops an option at its default passes
    # a round trip at the defaults, and a run that sets it rebuilds with the default
    lost = sorted((set(s.options) | set(option_names(s.cls))) - set(cfg))
    expect(not lost, "config", f"{cfg} without the option(s) {lost} of the constructor",
           "every option, so that a checkpoint rebuilds the same problem: return "
           "{**super().config(), OPTION: value, ...}")
    q = call("__init__ (from the checkpoint's record)", rebuild, meta)
    again = json.loads(json.dumps(call("config", q.config), allow_nan=True))
    expect(again == meta["kwargs"], "config", f"{again} after a rebuild from {meta['kwargs']}",
           "the same options")
    p.set_progress(PROGRESS)
    q.set_progress(PROGRESS)
    pa, xp = draw(p)
    qa, xq = draw(q)
    expect(np.array_equal(pa, qa) and torch.equal(xp, xq), "config", f"{cfg}, which rebuilds a "
           f"problem with other draws", "every option that changes the draws")
    raw = raw_field(p).detach()
    tp, tq = terms_of(p, raw, xp)[1], terms_of(q, raw, xq)[1]
    for k in tp:
        expect(close(tq[k], tp[k], 1e-12, 0.0), "config",
               f"{cfg}, which rebuilds a problem whose term {k!r} is {fmt(tq[k])}, not "
               f"{fmt(tp[k])}", "every option that changes the losses")
    return f"{meta['name']!r} and config() ({len(cfg)} options) rebuild the same draws and losses"


def where(cls) -> str:
    """The spec a checkpoint records for ``cls`` (:func:`problem_spec`), as a Fault if no
    other process could find the class."""
    try:
        return problem_spec(cls)
    except ValueError as e:
        raise Fault("problem_spec", raised=e) from None


def rebuild(meta: dict) -> Problem:
    """The problem a checkpoint's record {"name": spec, "kwargs": config()} rebuilds."""
    from diffnet.problems import get_problem

    return get_problem(meta["name"], **meta["kwargs"])
