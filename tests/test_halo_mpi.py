"""Domain parallelism's MPI block (deepfusion.engine.parallel.halo) with real processes: mpiexec -n 2
and -n 4 (oversubscribed on 2 cores: tiny grids). The checks themselves live in
tests/mpi_scripts/halo_check.py (halo forward vs F.pad of the global field, the halo adjoint,
sum, gather, geometry, refusals); the in-process tests cover the serial stand-ins."""
import pytest
import torch
import torch.nn.functional as F

from deepfusion.engine.parallel.comm import SerialComm
from deepfusion.engine.parallel.halo import MPIBlock, domain_groups, group_count, make_block
from diffnet.domain import Block
from tests.mpi_util import run_script_cases

pytestmark = pytest.mark.mpi
SCRIPT = "tests/mpi_scripts/halo_check.py"


def run_cases(n, cases):
    run_script_cases(n, SCRIPT, cases)


def test_two_ranks_split_along_either_axis_and_undivided():
    # 8x8:1x1 on 2 ranks: two domain groups of one rank each, the plain Block path
    run_cases(2, ["8x12:1x2", "8x12:2x1", "8x8:1x1"])


@pytest.mark.full
def test_four_ranks_2d_corners_3d_blocks_and_two_groups():
    # 2x1x2 on 4x8x8: blocks of 2 layers along axis 0, so width 2 == the block's size there
    run_cases(4, ["8x8:2x2", "4x8x8:1x2x2", "4x8x8:2x1x2", "8x12:1x2"])


def test_serial_sendrecv_and_allgather_copy_or_refuse():
    comm = SerialComm()
    src = torch.arange(6, dtype=torch.float64)
    dst = torch.zeros(6, dtype=torch.float64)
    comm.sendrecv_(src, 0, dst, 0)
    assert torch.equal(dst, src)
    comm.sendrecv_(None, None, None, None)  # nothing to do
    for dest, source in ((1, 1), (0, None), (None, 0)):
        with pytest.raises(ValueError, match="itself"):
            comm.sendrecv_(src, dest, dst, source)
    out = torch.zeros(1, 6, dtype=torch.float64)
    comm.allgather_(src, out)
    assert torch.equal(out[0], src)


def test_bf16_buffers_move_bit_for_bit_and_are_not_reduced():
    comm = SerialComm()
    src = torch.randn(5, dtype=torch.float64).to(torch.bfloat16)
    dst = torch.zeros(5, dtype=torch.bfloat16)
    comm.sendrecv_(src, 0, dst, 0)  # through as_buffer's int16 view of the bits
    assert torch.equal(dst, src)
    with pytest.raises(ValueError, match="reduce bfloat16"):
        comm.allreduce_(src)


@pytest.mark.parametrize("fill", ["zeros", "replicate"])
def test_one_block_mpi_block_is_the_undivided_block(fill):
    block = MPIBlock(SerialComm(), (4, 6), (1, 1))
    x = torch.randn(2, 3, 4, 6, dtype=torch.float64, requires_grad=True)
    y = block.halo(x, 2, fill)
    assert torch.equal(y, Block((4, 6)).halo(x, 2, fill))
    v = torch.randn_like(y)
    y.backward(v)
    xr = x.detach().clone().requires_grad_()
    F.pad(xr, [2] * 4, mode="constant" if fill == "zeros" else fill).backward(v)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-14, atol=1e-14)
    assert type(make_block(SerialComm(), (4, 6), (1, 1))) is Block


def test_refusals_without_a_launcher():
    with pytest.raises(ValueError, match="cannot be split"):
        MPIBlock(SerialComm(), (9, 8), (2, 1))
    with pytest.raises(ValueError, match="needs 2 ranks"):
        MPIBlock(SerialComm(), (8, 8), (2, 1))
    with pytest.raises(ValueError, match=r"parallel.domain = \[1, 2\].*job has 1 ranks"):
        domain_groups(SerialComm(), (1, 2))
    with pytest.raises(ValueError, match="width"):
        MPIBlock(SerialComm(), (4, 6), (1, 1)).halo(torch.zeros(1, 1, 4, 6), 5)


def test_group_count_is_the_one_check_of_ranks_against_a_split():
    """The training config, infer --domain and domain_groups all ask group_count: P ranks make
    P / prod(split) groups, or the refusal names the setting, the ranks that work and the
    splits that fit."""
    assert group_count(4, [1, 2]) == 2 and group_count(8, [2, 2, 2]) == 1
    assert group_count(3, [1, 1]) == 3
    with pytest.raises(ValueError) as e:
        group_count(3, [1, 2])
    msg = str(e.value)
    assert "parallel.domain = [1, 2] puts 2 ranks on every sample" in msg
    assert "has 3 ranks, not a multiple of 2: run on 2 or 4 ranks" in msg
    assert "a split with [1, 3] blocks in all" in msg
    with pytest.raises(ValueError, match=r"--domain 2x2 puts 4 ranks .* 6 ranks, not a multiple"):
        group_count(6, [2, 2], "--domain 2x2")
    with pytest.raises(ValueError, match="1 or more per axis"):
        group_count(2, [0, 2])

