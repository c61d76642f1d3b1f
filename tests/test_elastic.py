"""Elastic resume: a run checkpointed on P ranks continues on another P with the losses of the
uninterrupted run (float64), across the Adam -> L-BFGS switch too; a P that does not divide
data.global_batch is refused with the nearest valid ones. Real mpiexec processes; -n 4 is
oversubscribed on 2 cores, so everything is tiny."""
import os
import shutil

import pytest

from deepfusion.engine.faults import ENV as FAULT
from tests.mpi_util import deepfusion
from tests.test_engine_mpi import losses, tiny, train  # noqa: F401 (tiny: a fixture)
from tests.test_lbfgs import SWITCH

pytestmark = pytest.mark.mpi


def _cut(config, run_dir, every, fail_at, *sets):
    """A P=2 run killed by an exception on rank 1 at step ``fail_at`` (checkpoints every
    ``every`` steps)."""
    p = train(2, config, run_dir, f"train.checkpoint_every={every}", *sets,
              env={FAULT: f"raise@{fail_at}:1"})
    assert p.returncode != 0 and f"injected failure at step {fail_at}" in p.stderr


def _resume_on(n, cut, where, want):
    d = f"{cut}_p{n}"
    shutil.copytree(cut, d)
    p = deepfusion(n, ["train", "--resume", d])
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"checkpoint written on P = 2 ranks, continuing on P = {max(n, 1)}" in p.stdout
    assert where in p.stdout
    got = losses(d)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a == pytest.approx(b, rel=1e-9, abs=0), (n, got, want)


def test_p2_checkpoint_resumes_on_p1_and_p4_on_the_same_trajectory(tiny, tmp_path):
    full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
    assert train(2, tiny, full).returncode == 0
    _cut(tiny, cut, 8, 13)
    for n in (1, 4):
        _resume_on(n, cut, "step_00000008", losses(full))


def test_elastic_resume_across_the_adam_to_lbfgs_switch(tmp_path):
    cfg = tmp_path / "sw.toml"
    cfg.write_text(SWITCH)
    full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
    assert train(2, str(cfg), full).returncode == 0
    _cut(str(cfg), cut, 6, 8)  # the step-6 checkpoint holds an L-BFGS history
    for n in (1, 4):
        _resume_on(n, cut, "step_00000006", losses(full))


def test_a_p_that_does_not_divide_the_batch_is_refused_with_the_nearest_valid_ones(tiny, tmp_path):
    cut = str(tmp_path / "cut")
    _cut(tiny, cut, 8, 10)
    p = deepfusion(3, ["train", "--resume", cut])
    assert p.returncode == 2
    assert "not divisible by the number of ranks P = 3" in p.stderr
    assert "Run on P = 2 or 4 ranks" in p.stderr and p.stderr.count("deepfusion: error") == 1
