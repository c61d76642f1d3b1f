"""The problems' losses on real MPI domain blocks: mpiexec -n 2 ([1, 2], [2, 1]) and -n 4
([2, 2] and a 3-D [1, 2, 2]), oversubscribed on 2 cores, so tiny grids. The checks live in
tests/mpi_scripts/split_loss_check.py (terms summed over the blocks and their gradients ==
the undivided ones, float64); tests/test_problems_on_blocks.py covers every configuration
in-process with a threaded stand-in of the MPI block."""
import pytest

from tests.mpi_util import run_script_cases

pytestmark = pytest.mark.mpi
SCRIPT = "tests/mpi_scripts/split_loss_check.py"


def run_cases(n, cases):
    run_script_cases(n, SCRIPT, cases)


def test_two_ranks_split_either_axis():
    run_cases(2, ["16x16:1x2", "16x16:2x1"])


@pytest.mark.full
def test_four_ranks_split_both_axes_and_3d():
    run_cases(4, ["16x16:2x2", "8x8x8:1x2x2"])
