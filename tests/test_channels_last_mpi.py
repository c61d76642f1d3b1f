"""The default ``model.channels_last = true`` path under mpiexec (the other multi-rank tests run
NCHW): the allreduced gradient and the training trajectory do not depend on the number of ranks.

-n 4 is oversubscribed on 2 cores: everything here is tiny. Timeouts are hang guards only.
"""
import os

import pytest

from tests.mpi_util import run_mpi
from tests.test_engine_mpi import losses, losses_on_every_p, train
from tests.tiny_configs import TINY, variant

pytestmark = pytest.mark.mpi

TINY_NHWC = variant(TINY, "model.channels_last=true")


@pytest.fixture
def tiny_nhwc(tmp_path):
    path = tmp_path / "tiny_nhwc.toml"
    path.write_text(TINY_NHWC)
    return str(path)


@pytest.mark.parametrize("n,variants", [(2, ["channels-last", "channels-last+overlap"]),
                                        (4, ["channels-last"])])
def test_channels_last_allreduced_gradient_equals_full_batch_gradient(n, variants):
    """With channels_last models and inputs, the P-rank allreduced gradient (several small
    buckets, reduced after or during backward) equals the single-process gradient of the whole
    global batch (float64, rtol 1e-10); the script also checks that every instance norm took
    the NHWC kernel and that the bucketed 4-D gradients kept the weights' channels_last strides."""
    p = run_mpi(n, ["tests/mpi_scripts/grad_check.py"] + variants)
    assert p.returncode == 0, p.stderr
    for v in variants:
        assert f"OK P={n} variant={v} channels_last=True" in p.stdout, p.stdout


def test_channels_last_training_same_losses_for_any_number_of_ranks(tiny_nhwc, tmp_path):
    """`deepfusion train` of the tiny float64 config with channels_last = true gives the same
    per-step losses (rtol 1e-9) in a plain process and under mpiexec -n 2 (-n 4: the NCHW
    test in test_engine_mpi; the layout does not touch the communication), the loss decreases,
    and the run's saved config records channels_last = true."""
    runs = losses_on_every_p(tiny_nhwc, tmp_path, ranks=(0, 2))
    assert len(runs[0]) == 20  # 16 samples / global batch 4 x 5 epochs
    for n in runs:
        with open(os.path.join(tmp_path, f"p{n}", "config.toml")) as f:
            assert "channels_last = true" in f.read()


def test_channels_last_first_loss_equals_nchw_first_loss(tiny_nhwc, tmp_path):
    """The first step's loss (same initial weights, same batch, before any update) is the same
    with channels_last = true and false (float64, rtol 1e-12): NHWC changes the memory layout,
    never the function."""
    first = {}
    for layout in ("true", "false"):
        d = str(tmp_path / layout)
        p = train(0, tiny_nhwc, d, f"model.channels_last={layout}", "train.max_steps=1")
        assert p.returncode == 0, p.stderr
        first[layout] = losses(d)
        assert len(first[layout]) == 1, first[layout]
    assert first["true"][0] == pytest.approx(first["false"][0], rel=1e-12)
