"""Plugin families with boundary data (tests/plugins/boundary_families.py: non-zero Dirichlet
data through a lift, a Neumann or Robin wall) pass check-problem, split [1, 2] and [2, 2]
included, and their losses vanish at their reference solutions (the helpers' discrete
conditions are the reference scheme's); a broken plugin's check-problem failures name its file
and the line of the method at fault."""
from __future__ import annotations

import inspect
import pathlib
import re

import pytest
import torch

from diffnet.problems import get_problem
from diffnet.problems.check.problem import ProblemCheckFailed, check_problem

FAMILIES = "tests.plugins.boundary_families"
BROKEN = "tests.plugins.broken_loss"
BROKEN_FILE = pathlib.Path(__file__).parent / "plugins" / "broken_loss.py"


@pytest.mark.parametrize("spec,options", [("WarmPlate", {}), ("FluxPlate", {}),
                                          ("FluxPlate", {"alpha": 2.0})], ids=str)
def test_boundary_families_pass_check_problem_split_included(spec, options):
    report = check_problem(f"{FAMILIES}:{spec}", options=options)
    assert report.ok, report.text()
    done = {r.check: r for r in report.results}
    for split in ("[1, 2]", "[2, 2]"):
        assert done[f"split {split} against undivided"].status == "OK"


@pytest.mark.parametrize("spec,options", [("WarmPlate", {}), ("FluxPlate", {}),
                                          ("FluxPlate", {"alpha": 2.0})], ids=str)
def test_the_losses_vanish_at_the_reference_solution(spec, options):
    p = get_problem(f"{FAMILIES}:{spec}", grid=(17, 21), **options)
    params = p.sample_params(3, range(2))
    x = p.build_input(params, dtype=torch.float64)
    ref = torch.stack([torch.tensor(p.reference_solution(q)) for q in params])[:, None]
    terms = p.loss_terms(ref, x)
    assert all(float(t.max()) < 1e-16 for t in terms.values()), terms
    # the walls of the reference hold the data the network's answer is given
    raw = torch.randn(ref.shape, dtype=torch.float64)
    u = p.answer(raw, x)
    dirichlet_rows = (0, -1) if spec == "WarmPlate" else (0,)
    for k in dirichlet_rows:
        assert torch.allclose(u[..., k], ref[..., k], rtol=0, atol=1e-12)
    assert torch.allclose(u[..., 0, :], ref[..., 0, :], rtol=0, atol=1e-12)
    # not vacuous: away from the reference the terms do not vanish
    off = p.loss_terms(ref + 0.01 * torch.rand(ref.shape, dtype=torch.float64), x)
    moved = ("pde", "bc") if spec == "FluxPlate" else ("pde",)      # WarmPlate's bc: exact
    assert all(float(off[k].min()) > 1e-8 for k in moved), off


def line_of(marker: str) -> int:
    lines = BROKEN_FILE.read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if marker in text)


def test_a_failure_names_the_plugin_file_and_the_line_of_the_method():
    from tests.plugins.broken_loss import Misshapen

    report = check_problem(f"{BROKEN}:Misshapen")
    bad = next(r for r in report.results if r.check == "shapes and dtypes, float32")
    assert bad.status == "FAIL" and bad.method == "loss_terms (term 'pde')"
    line = line_of("check-problem: a wrong return")
    assert line == inspect.getsourcelines(Misshapen.loss_terms)[1]
    where = f"[Misshapen.loss_terms at tests/plugins/broken_loss.py:{line}]"
    assert bad.line().endswith(where), bad.line()
    with pytest.raises(ProblemCheckFailed, match=re.escape(where)):
        report.assert_ok()


def test_a_method_that_raised_is_named_at_the_line_that_raised(cli):
    rc, out, _ = cli(["check-problem", f"{BROKEN}:NoSuchWall"])
    assert rc == 1
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert fails and all("unknown wall 'right'" in line for line in fails), out
    where = f"[NoSuchWall.loss_terms at tests/plugins/broken_loss.py:{line_of('it raised here')}]"
    assert all(line.endswith(where) for line in fails), out


def test_a_constructor_that_raises_is_named_at_its_line():
    from diffnet.problems.check.problem import ProblemSpecError
    from tests.test_check_problem import Smooth

    with pytest.raises(ProblemSpecError) as e:
        check_problem(Smooth, options={"weight": "heavy"})
    line = inspect.getsourcelines(Smooth.__init__)[1] + 2        # self.weight = float(weight)
    assert str(e.value).endswith(f"[Smooth.__init__ at tests/test_check_problem.py:{line}]")
