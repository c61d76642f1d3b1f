"""What docs/your-own-pde.md tells a newcomer the checker catches: a ``config()`` that drops a
constructor option fails even when the problem is built at its defaults (the page's first
``check-problem`` runs there), and a wrong number of axes says how ``dims`` is set; the
step-by-step excerpts (``<!-- excerpt: FILE -->``) are verbatim pieces of FILE."""
from __future__ import annotations

import pathlib
import re

from diffnet.problems import Axis
from diffnet.problems.check.problem import check_problem
from tests.test_check_problem import ForgetsAnOption, Smooth

ROOT = pathlib.Path(__file__).resolve().parents[1]


class ThreeAxes(Smooth):
    """Three axes on a problem that keeps the default ``dims = 2``."""

    @property
    def axes(self):
        return tuple(Axis(n, 0.0, 1.0) for n in "zyx")


def test_a_config_that_drops_an_option_fails_at_the_defaults_naming_the_fix():
    bad = check_problem(ForgetsAnOption).results
    bad = next(r for r in bad if r.check == "checkpoint round trip")
    assert bad.status == "FAIL" and bad.method == "config"
    assert "['weight'] of the constructor" in bad.detail
    assert "{**super().config(), OPTION: value, ...}" in bad.detail


def test_axes_that_do_not_match_dims_say_how_a_3d_problem_sets_dims():
    bad = next(r for r in check_problem(ThreeAxes).results if r.check == "class attributes")
    assert bad.status == "FAIL" and bad.method == "axes"
    assert "a 3-D problem sets dims = 3" in bad.detail


EXCERPT = re.compile(r"<!-- excerpt: (\S+) -->\n```\w*\n(.*?)\n```", re.S)


def test_the_step_by_step_excerpts_are_verbatim_pieces_of_their_files():
    page = (ROOT / "docs" / "your-own-pde.md").read_text()
    excerpts = EXCERPT.findall(page)
    assert len(excerpts) >= 6
    for path, text in excerpts:
        assert text in (ROOT / path).read_text(), f"docs/your-own-pde.md: the excerpt of {path} " \
            f"starting {text.splitlines()[0]!r} is not in the file: copy it again"
