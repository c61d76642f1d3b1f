"""A U-Net split over a domain group with real processes (mpiexec -n 2 and -n 4,
oversubscribed on 2 cores: tiny networks): output, parameter gradients and input gradient equal
the undivided network's (float64, rtol 1e-10), grown networks (a chain of three) included on
their way down and up again. The checks live in
tests/mpi_scripts/split_unet_check.py; the serial tests are tests/test_split_layers.py."""
import pytest

from tests.mpi_util import run_script_cases

pytestmark = pytest.mark.mpi
SCRIPT = "tests/mpi_scripts/split_unet_check.py"


def run_cases(n, cases):
    run_script_cases(n, SCRIPT, cases)


def test_two_ranks_split_along_either_axis():
    run_cases(2, ["16x16:1x2:instance", "16x32:2x1:none", "16x16:2x1:instance,avgpool,transpose",
                  "16x16:1x2:instance,cl,ck", "8x8x8:1x2x1:instance",
                  "16x16:2x1:instance,prolong", "16x16:1x2:none,prolong,frozen,cl",
                  "32x32:1x2:instance,nest,ck", "16x16x16:1x1x2:none,nest,frozen,d1"])


@pytest.mark.full
def test_four_ranks_corners_3d_blocks_and_two_groups():
    # 16x16:1x2 on 4 ranks: two domain groups of two ranks each
    run_cases(4, ["16x16:2x2:instance", "16x32:2x2:none,avgpool,transpose",
                  "8x8x8:2x1x2:instance,cl", "8x8x8:2x2x1:none,transpose,d1",
                  "16x16:1x2:instance", "16x32:2x2:instance,prolong",
                  "16x8x16:2x1x2:none,prolong,d1", "32x32:2x2:none,nest,cl"])
