"""The problem checker (``diffnet.problems.check.problem``, ``deepfusion check-problem``): every
registered problem passes it; a problem written with the public API passes it; a problem
broken in one way fails the check of that way, naming the method at fault; the exit codes."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from diffnet.problems import PROBLEMS, Axis, Problem
from diffnet.problems.check.problem import ProblemCheckFailed, ProblemSpecError, check_problem
from diffnet.stencils import FiniteDifference

HERE = __name__          # "tests.test_check_problem": the classes below as module:Class


# -- a small problem written with the public API, and broken copies of it ------------------------
class Smooth(Problem):
    """Fit u to a drawn field f with a smoothness penalty and a soft condition u = 0 on the row
    y = 0: pde = mean (u - f)^2 + smoothing * mean (du/dx)^2, bc = weight * mean of u^2 on row
    0. Split exactly by the helpers: ``self.mean``, ``self.wall_mean`` and ``FiniteDifference``
    on ``self.block``."""

    name = "smooth_fit"
    param_names = ("a", "k")
    input_channels = ("f",)

    def __init__(self, *, grid=(16, 16), weight: float = 1.0, smoothing: float = 0.1):
        super().__init__(grid=grid)
        self.weight, self.smoothing = float(weight), float(smoothing)
        self.fd = FiniteDifference(self.spacing, derivatives=("c",))

    @property
    def axes(self):
        return (Axis("y", 0.0, 1.0), Axis("x", 0.0, 1.0))

    def param_bounds(self):
        return np.array([[-1.0, 1.0], [0.5, 2.0]])

    def config(self):
        return {**super().config(), "weight": self.weight, "smoothing": self.smoothing}

    def build_input(self, params, dtype=torch.float32):
        params = self.check_params(params)
        c = self.coords()
        y, x = np.meshgrid(c["y"], c["x"], indexing="ij")
        f = params[:, 0, None, None] * np.sin(np.pi * params[:, 1, None, None] * x) + y
        return torch.tensor(f[:, None], dtype=dtype)

    def impose(self, u, inputs):
        return u

    def pde(self, u, inputs):
        ux = self.fd(u, self.block)
        fit = (u - inputs[:, :1]).square() + self.smoothing * ux.square()
        return self.mean(fit)

    def loss_terms(self, u, inputs):
        bc = self.wall_mean(u.square(), axis=0, side="lo")
        return {"pde": self.pde(u, inputs), "bc": self.weight * bc}

    def reference_solution(self, params, method="auto"):
        """The field f itself: the minimiser of the fit alone (a stand-in, enough here)."""
        self.check_method(method)
        return self.build_input(np.atleast_2d(params), torch.float64)[0, 0].numpy()


class WrongLossShape(Smooth):
    def loss_terms(self, u, inputs):
        return {k: v[:, None] for k, v in super().loss_terms(u, inputs).items()}


class LossInFloat64(Smooth):
    def loss_terms(self, u, inputs):
        return {k: v.double() for k, v in super().loss_terms(u, inputs).items()}


class MixesSamples(Smooth):
    def loss_terms(self, u, inputs):
        terms = super().loss_terms(u, inputs)
        return {**terms, "pde": terms["pde"] + 0.1 * u.mean()}   # the mean of the whole batch


class RandomDraws(Smooth):
    def sample_params(self, seed, indices):
        n = len(list(indices))
        b = self.param_bounds()
        return b[:, 0] + (b[:, 1] - b[:, 0]) * np.random.default_rng().random((n, 2))


class BlockMean(Smooth):
    def pde(self, u, inputs):                 # a mean over the block's own nodes: not split-exact
        ux = self.fd(u, self.block)
        return ((u - inputs[:, :1]).square() + self.smoothing * ux.square()).mean(dim=(1, 2, 3))


class HalfGradient(Smooth):
    def pde(self, u, inputs):                 # the value of pde, half its gradient
        v = super().pde(u, inputs)
        return 0.5 * v + 0.5 * v.detach()


class ForgetsAnOption(Smooth):
    def config(self):
        return {"grid": list(self.grid), "smoothing": self.smoothing}


class WholeGridOnly(Smooth):
    def check_block(self, block):
        raise ValueError("smooth_fit with this option needs the whole grid")


class UnsplitTerm(BlockMean):
    unsplit_terms = ("pde",)                  # declared: a split is refused, naming the term


class NoReference(Smooth):
    reference_solution = Problem.reference_solution   # the contract's default: none


BROKEN = [  # (class, options, the check that fails, the method it names)
    (WrongLossShape, {}, "shapes and dtypes, float64", "loss_terms (term 'pde')"),
    (LossInFloat64, {}, "shapes and dtypes, float32", "loss_terms (term 'pde')"),
    (MixesSamples, {}, "per-sample terms", "loss_terms (term 'pde')"),
    (RandomDraws, {}, "deterministic draws", "sample_params"),
    (BlockMean, {}, "split [1, 2] against undivided", "loss_terms on blocks [1, 2]"),
    (HalfGradient, {}, "float64 gradient", "loss_terms (backward)"),
    (ForgetsAnOption, {"weight": 2.0}, "checkpoint round trip", "config"),
]


def results(report) -> dict:
    return {r.check: r for r in report.results}


# -- every registered problem, and a user's ------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_every_registered_problem_passes(name):
    report = check_problem(name).assert_ok()
    done = results(report)
    assert done["float64 gradient"].status == "OK"
    assert done["per-sample terms"].status == "OK"


@pytest.mark.parametrize("spec", [Smooth, f"{HERE}:Smooth"], ids=["class", "module:Class"])
def test_a_problem_written_with_the_public_api_passes(spec):
    report = check_problem(spec, options={"weight": 2.0})
    assert report.ok, report.text()
    assert all(r.status == "OK" for r in report.results
               if r.check not in ("solve_from_inputs", "answer head"))
    assert "split [2, 2] against undivided: 4 blocks" in report.text()
    assert f"'{HERE}:Smooth'" in results(report)["checkpoint round trip"].detail


@pytest.mark.parametrize("cls,options,check,method", BROKEN,
                         ids=lambda v: getattr(v, "__name__", None))
def test_a_broken_problem_fails_that_check_naming_the_method(cls, options, check, method):
    report = check_problem(cls, options=options)
    assert not report.ok
    bad = results(report)[check]
    assert bad.status == "FAIL" and bad.method == method, report.text()
    assert bad.line().startswith(f"FAIL  {check}: {method} returned ")
    assert "expected" in bad.detail
    with pytest.raises(ProblemCheckFailed, match=re.escape(method)):
        report.assert_ok()


def test_the_failures_say_what_was_returned():
    text = check_problem(WrongLossShape).text()
    assert "a tensor of shape (3, 1) and dtype torch.float64" in text and "shape (3,)" in text
    text = check_problem(MixesSamples).text()
    assert "for sample 0 alone but" in text and "in a batch of 3" in text
    text = check_problem(ForgetsAnOption, options={"weight": 2.0}).text()
    assert "without the option(s) ['weight']" in text


@pytest.mark.parametrize("cls,why", [
    (WholeGridOnly, "needs the whole grid"),
    (UnsplitTerm, "loss term(s) ['pde'] on the whole grid only (they are not written with the "
                  "split-exact helpers")])
def test_a_refused_split_is_no_domain_parallelism_not_a_failure(cls, why):
    report = check_problem(cls)
    assert report.ok, report.text()
    for split in ("[1, 2]", "[2, 2]"):
        r = results(report)[f"split {split} against undivided"]
        assert r.status == "SKIP" and "no domain parallelism" in r.detail
        assert why in r.detail


def test_a_term_with_a_stop_gradient_is_left_out_of_the_gradient_check_and_named():
    """Burgers' basin term holds its target fixed: declared in detached_terms, it passes."""
    report = check_problem("burgers", options={"scheme": "lax-oleinik", "basin_weight": 0.1})
    assert report.ok, report.text()
    grad = results(report)["float64 gradient"]
    assert grad.status == "OK" and "without the detached terms ['pde']" in grad.detail

    class AllDetached(Smooth):
        detached_terms = ("pde", "bc")
    grad = results(check_problem(AllDetached))["float64 gradient"]
    assert grad.status == "SKIP" and "every loss term is declared detached" in grad.detail


def test_a_family_without_a_reference_solver_skips_those_checks():
    report = check_problem(NoReference)
    assert report.ok, report.text()
    assert results(report)["reference_solution"].status == "SKIP"
    assert "no reference solver" in results(report)["reference_solution"].detail


def test_a_class_no_other_process_can_import_fails_the_round_trip():
    class Local(Smooth):
        pass

    bad = results(check_problem(Local))["checkpoint round trip"]
    assert bad.status == "FAIL" and bad.method == "problem_spec" and "function" in bad.detail


@pytest.mark.parametrize("spec,options,grid,needle", [
    ("no_such_module_here:Heat", {}, None, "cannot import module 'no_such_module_here'"),
    (f"{HERE}:NotThere", {}, None, "no attribute 'NotThere'"),
    ("heat", {}, None, "unknown problem 'heat'"),
    (Smooth, {"nope": 1}, None, "unknown option(s) ['nope']"),
    (Smooth, {"weight": "heavy"}, None, "cannot be built"),
    (Smooth, {}, (8, 8, 8), "has 3 axes"),
])
def test_bad_specs_and_options_are_refused_before_any_check(spec, options, grid, needle):
    with pytest.raises(ProblemSpecError) as e:
        check_problem(spec, options=options, grid=grid)
    assert needle in str(e.value)


# -- the command ---------------------------------------------------------------------------------
def test_cli_prints_one_line_per_check_and_exits_0(cli):
    rc, out, err = cli(["check-problem", f"{HERE}:Smooth", "--grid", "16x12",
                        "--set", "weight=3.0", "--options", "{smoothing = 0.2}"])
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == f"checking problem {HERE}:Smooth with options {{'smoothing': 0.2, " \
                       f"'weight': 3.0}}"
    assert all(line.startswith(("OK ", "SKIP ")) for line in lines[1:-1])
    assert "OK    float64 gradient" in out and "OK    split [2, 2] against undivided" in out
    n = len(lines) - 2
    assert lines[-1] == f"{HERE}:Smooth on 16x12: {n - 2} OK, 0 FAIL, 2 SKIP"


def test_cli_exits_1_when_a_check_fails(cli):
    rc, out, _ = cli(["check-problem", f"{HERE}:MixesSamples"])
    assert rc == 1
    assert "FAIL  per-sample terms: loss_terms (term 'pde') returned" in out


@pytest.mark.parametrize("args,needle", [
    (["no_such_module_here:Heat"], "cannot import module"),
    ([f"{HERE}:Smooth", "--set", "nope=1"], "unknown option(s) ['nope']"),
    ([f"{HERE}:Smooth", "--options", "{weight = "], "--options must be a TOML table"),
    ([f"{HERE}:Smooth", "--grid", "16"], "--grid must look like HxW"),
    ([f"{HERE}:Smooth", "--set", "grid=[8, 8]"], "give --grid"),
])
def test_cli_exits_2_on_bad_input_with_one_message(cli, args, needle):
    rc, out, err = cli(["check-problem", *args])
    assert rc == 2 and out == ""
    assert err.count("deepfusion: error:") == 1 and needle in err
