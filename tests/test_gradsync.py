"""GradSync's overlap drives MPI's progress from the backward pass: with ``poll`` every
post-accumulate hook tests the oldest unfinished request (MPICH makes no progress of its own)."""
import pytest
import torch

from deepfusion.engine.parallel.comm import SerialComm
from deepfusion.engine.parallel.gradsync import GradSync
from diffnet.generators import build_generator


class PendingRequest:
    """A request that completes on its ``polls``-th Test (or at wait), counting the Tests."""

    def __init__(self, log, polls=3):
        self.log, self.left = log, polls

    def Test(self):  # noqa: N802 (mpi4py's name)
        self.log.append("test")
        self.left -= 1
        return self.left <= 0

    def wait(self):
        self.log.append("wait")


class TwoRanks(SerialComm):
    """SerialComm posing as 2 ranks, so GradSync installs its overlap hooks."""

    size = 2

    def __init__(self):
        self.log = []

    def iallreduce_(self, buf, op="sum"):
        self.log.append("start")
        return PendingRequest(self.log)


@pytest.mark.parametrize("poll", [True, False])
def test_overlap_polls_started_buckets_during_backward(poll):
    torch.manual_seed(0)
    model = build_generator("unet", in_channels=2, depth=2, base_width=4)
    comm = TwoRanks()
    gs = GradSync(model, comm, bucket_mb=0.01, overlap=True, poll=poll)
    assert len(gs.buckets) > 2
    model(torch.randn(2, 2, 16, 16)).square().mean().backward()
    during = list(comm.log)
    assert during.count("start") == len(gs.buckets)
    # Polled: Tests come between the starts, inside backward; unpolled: none until reduce.
    assert ("test" in during) == poll
    if poll:
        assert during.index("test") < len(during) - 1 - during[::-1].index("start")
    gs.reduce()
    assert comm.log.count("wait") == len(gs.buckets)
    comm.log.clear()
    gs.zero_()
    model(torch.randn(2, 2, 16, 16)).square().mean().backward()  # the next step starts afresh
    assert comm.log.count("start") == len(gs.buckets)
