"""The known trap ``train`` warns about before the first step: a network with instance norm
fed an input channel that is spatially constant in every draw while it changes from draw to
draw (a number the norm erases). Built-ins do not trip it, a family opts a channel out with
``loss_only_channels``, check-problem checks that attribute, and a run warns once."""
from __future__ import annotations

import pytest

from deepfusion.app.traps import constant_channels, normalises_inputs
from diffnet.generators import build_generator
from diffnet.problems import PROBLEMS, get_problem
from diffnet.problems.check.problem import check_problem
from tests.in_process import deepfusion_here
from tests.plugins.constant_input import ConstantInput, ConstantInputMarked
from tests.tiny_configs import TINY, variant


def test_a_constant_channel_that_carries_a_number_is_found():
    p = ConstantInput(grid=(16, 16))
    assert constant_channels(p, 0, range(4)) == ["a_1"]
    assert constant_channels(ConstantInputMarked(grid=(16, 16)), 0, range(4)) == []
    assert constant_channels(p, 0, [3]) == []  # one draw cannot tell a number from a constant


@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_no_built_in_problem_trips_it(name):
    cls = PROBLEMS[name]
    p = get_problem(cls, grid=(16, 16, 16) if cls.dims == 3 else (16, 16))
    assert constant_channels(p, 0, range(8)) == []


def test_only_a_network_that_normalises_per_sample_is_concerned():
    assert normalises_inputs(build_generator("unet", in_channels=2, depth=1, base_width=4))
    assert not normalises_inputs(build_generator("unet", in_channels=2, depth=1, base_width=4,
                                                 norm="none"))


def test_check_problem_refuses_a_loss_only_channel_that_is_no_input():
    class Stray(ConstantInputMarked):
        """``ConstantInputMarked`` naming a channel it does not have.

        ``amplitude_range`` is the interval both amplitudes are drawn from (default (0.5, 1.5)).
        """

        name = "stray"
        loss_only_channels = ("b",)

    report = check_problem(Stray, grid=(16, 16))
    bad = [r for r in report.results if r.status != "OK" and "loss_only_channels" in str(r)]
    assert bad, report
    assert check_problem(ConstantInputMarked, grid=(16, 16)).ok


@pytest.mark.parametrize("cls,warns", [("ConstantInput", True), ("ConstantInputMarked", False)])
def test_train_warns_once_naming_the_channel_and_the_fix(tmp_path, cls, warns):
    path = tmp_path / "c.toml"
    path.write_text(variant(TINY, f'problem.name="tests.plugins.constant_input:{cls}"',
                            "train.epochs=1", "data.eval_samples=0"))
    p = deepfusion_here(["train", str(path), "--set", f"run.dir={tmp_path / 'run'}"])
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("deepfusion: warning: input channel 'a_1'") == int(warns)
    if warns:
        assert "loss_only_channels = ('a_1',)" in p.stderr and "instance norm" in p.stderr


def test_check_says_it_before_the_job_runs(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(variant(TINY, 'problem.name="tests.plugins.constant_input:ConstantInput"'))
    p = deepfusion_here(["check", str(path), "--ranks", "2", "--no-probe"])
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("deepfusion: warning: input channel 'a_1'") == 1
