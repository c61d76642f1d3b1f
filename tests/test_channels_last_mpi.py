"""The default ``model.channels_last = true`` path through ``deepfusion train`` (the other
multi-rank training tests run NCHW): the training trajectory does not depend on the number of
ranks, and the layout never changes the function. (The channels-last allreduced gradient on 2
and 4 ranks: test_engine_mpi, in the gradient check's launches.)

Timeouts are hang guards only.
"""
import os

import pytest

from tests.test_engine_mpi import losses, losses_on_every_p
from tests.tiny_configs import TINY, variant
from tests.tiny_runs import trained

pytestmark = pytest.mark.mpi

TINY_NHWC = variant(TINY, "model.channels_last=true")


def test_channels_last_training_same_losses_for_any_number_of_ranks(tmp_path_factory):
    """`deepfusion train` of the tiny float64 config with channels_last = true gives the same
    per-step losses (rtol 1e-9) in a plain process and under mpiexec -n 2 (-n 4: the NCHW
    test in test_engine_mpi; the layout does not touch the communication), the loss decreases,
    and the run's saved config records channels_last = true."""
    runs = losses_on_every_p(tmp_path_factory, TINY_NHWC, ranks=(0, 2))
    assert len(losses(runs[0])) == 20  # 16 samples / global batch 4 x 5 epochs
    for d in runs.values():
        with open(os.path.join(d, "config.toml")) as f:
            assert "channels_last = true" in f.read()


def test_channels_last_first_loss_equals_nchw_first_loss(tmp_path_factory):
    """The first step's loss (same initial weights, same batch, before any update) is the same
    with channels_last = true and false (float64, rtol 1e-12): NHWC changes the memory layout,
    never the function. (The one-process runs of both layouts, shared with the tests that
    compare them across ranks.)"""
    first = {}
    for layout, config in (("true", TINY_NHWC), ("false", TINY)):
        d = trained(tmp_path_factory, config, 0)
        with open(os.path.join(d, "config.toml")) as f:
            assert f"channels_last = {layout}" in f.read()
        first[layout] = losses(d)[0]
    assert first["true"] == pytest.approx(first["false"], rel=1e-12)
