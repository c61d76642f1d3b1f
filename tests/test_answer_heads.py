"""The answer head (diffnet.problems.contract.heads): a user's quadratic-energy problem answers through
the Ritz head with the public pieces only, the problem checker checks a head, and problems
without one (the Plain head, or an impose of their own that combines fields) answer as before."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from diffnet.answer import Answer
from diffnet.generators import build_generator
from diffnet.problems import PROBLEMS, Plain, QuadraticEnergy, Ritz, get_problem
from diffnet.problems.check.problem import check_problem
from examples.heat import Heat

HERE = __name__


class RitzHeat(Heat, QuadraticEnergy):
    """The heat family of examples/heat.py, answered by the Ritz head from two fields.

    ``amplitude_range`` is the interval both amplitudes are drawn from (default (0.5, 1.5)).
    """

    name = "ritz_heat"
    head = Ritz(fields=2)

    def quadratic_features(self, u, inputs):
        hy, hx = self.spacing
        (y0, y1), (x0, x1) = self.edges(u)
        return [(x1 - x0, 0.5 * hy / hx), (y1 - y0, 0.5 * hx / hy)]

    def load(self, inputs, like):
        hy, hx = self.spacing
        return hx * hy * inputs[:, :1].to(like)


class PartitionHeat(RitzHeat):
    """RitzHeat with coefficient fields on a 3 x 3 partition."""

    head = Ritz(fields=2, partition=3)


class HalfEnergyHeat(RitzHeat):
    """A head energy that is not the loss: the load counted twice."""

    def load(self, inputs, like):
        return 2 * super().load(inputs, like)


class NotAnEnergy(Heat):
    """A Ritz head on a problem that does not give its quadratic energy."""

    head = Ritz(fields=2)


class SumsItsFields(Heat):
    """Two network fields summed by the problem's own impose, with the Plain head."""

    output_channels = 2

    def impose(self, u, inputs):
        return super().impose(u.sum(dim=1, keepdim=True), inputs)


def modes(p) -> torch.Tensor:
    """(1, 2, *grid) the two sine modes of the heat source: exact discrete eigenvectors."""
    y, x = np.meshgrid(p.coords()["y"], p.coords()["x"], indexing="ij")
    return torch.tensor(np.stack([np.sin(np.pi * x) * np.sin(np.pi * y),
                                  np.sin(2 * np.pi * x) * np.sin(np.pi * y)]))[None]


@pytest.mark.parametrize("cls", [RitzHeat, PartitionHeat])
def test_a_users_quadratic_energy_answers_through_the_ritz_head(cls):
    """Fields that span the solution give the reference (up to the solve's 1e-7 shift of G),
    through problem.answer and the Answer module; the network takes the head's channels."""
    p = cls(grid=(17, 17))
    assert p.output_channels == 2 and p.config() == {"grid": [17, 17],
                                                     "amplitude_range": [0.5, 1.5]}
    params = p.sample_params(0, range(2))
    x = p.build_input(params, dtype=torch.float64)
    ref = np.stack([p.reference_solution(q) for q in params])
    u = p.answer(modes(p).expand(2, -1, -1, -1) * torch.tensor([1.0, -3.0]).view(1, 2, 1, 1), x)
    assert u.shape == (2, 1, 17, 17)
    assert np.abs(u[:, 0].numpy() - ref).max() < 1e-5 * np.abs(ref).max()
    torch.manual_seed(0)
    net = build_generator("unet", in_channels=1, out_channels=p.output_channels, depth=2,
                          base_width=4).double()
    q = cls(grid=(16, 16))
    assert Answer(net, q)(q.build_input(params, dtype=torch.float64)).shape == (2, 1, 16, 16)


@pytest.mark.parametrize("cls", [RitzHeat, PartitionHeat])
def test_the_checker_passes_a_users_ritz_head_split_included(cls):
    report = check_problem(cls)
    assert report.ok, report.text()
    text = report.text()
    assert f"OK    answer head: {cls.head!r}: the answer is stationary" in text
    assert "split [2, 2] against undivided: 4 blocks" in text


def test_a_head_energy_that_is_not_the_loss_fails_the_head_check():
    report = check_problem(HalfEnergyHeat)
    bad = [r for r in report.failures if r.check == "answer head"]
    assert bad and "the head's energy (quadratic_features, load) must be the loss" \
        in bad[0].detail, report.text()


def test_a_ritz_head_needs_a_quadratic_energy():
    p = NotAnEnergy(grid=(16, 16))
    x = p.build_input(p.sample_params(0, range(1)), dtype=torch.float64)
    with pytest.raises(ValueError, match="is not a diffnet.problems.QuadraticEnergy"):
        p.answer(torch.ones(1, 2, 16, 16, dtype=torch.float64), x)
    report = check_problem(NotAnEnergy)
    head = [r for r in report.results if r.check == "answer head"][0]
    assert head.status == "FAIL" and "QuadraticEnergy" in head.detail


def test_a_partition_the_grid_cannot_hold_is_refused():
    with pytest.raises(ValueError, match="a partition of 8 x 8 cells needs a 2-D grid of at "
                                         "least 9 nodes per axis, got \\[6, 6\\]"):
        Ritz(fields=1, partition=8).partition_of((6, 6))
    with pytest.raises(ValueError, match="fields must be an integer >= 1"):
        Ritz(fields=0)


def test_an_impose_that_combines_fields_keeps_the_plain_head():
    """A problem whose own impose maps its fields to one (output_channels declared as a class
    attribute) answers with its impose; the checker passes it."""
    p = SumsItsFields(grid=(16, 16))
    assert p.output_channels == 2 and isinstance(p.head, Plain)
    x = p.build_input(p.sample_params(0, range(2)), dtype=torch.float64)
    raw = torch.rand(2, 2, 16, 16, dtype=torch.float64)
    assert torch.equal(p.answer(raw, x), p.impose(raw, x))
    assert Heat(grid=(16, 16)).output_channels == 1      # Heat's: its head's channels
    with pytest.raises(AttributeError):                   # one way to declare it: the class
        Heat(grid=(16, 16)).output_channels = 3           # attribute, not an instance's
    assert check_problem(SumsItsFields).ok


@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_without_a_head_the_answer_is_the_imposed_field(name):
    p = get_problem(name, grid=(8, 8, 8) if PROBLEMS[name].dims == 3 else (16, 16))
    assert isinstance(p.head, Plain) and p.output_channels == 1
    x = p.build_input(p.sample_params(0, range(2)), dtype=torch.float64)
    raw = torch.rand(2, 1, *p.grid, dtype=torch.float64)
    assert torch.equal(p.answer(raw, x), p.impose(raw, x))


def test_ritz_options_build_the_head():
    p = get_problem("darcy", grid=(16, 16), ritz=True, ritz_fields=3, ritz_partition=2)
    assert repr(p.head) == "Ritz(fields=3, partition=2)" and p.output_channels == 3
    assert p.config()["ritz_fields"] == 3 and p.config()["ritz_partition"] == 2
    assert isinstance(get_problem("darcy", grid=(16, 16)).head, Plain)
