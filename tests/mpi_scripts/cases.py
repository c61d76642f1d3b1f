"""What every case-running MPI check script shares: run each case given on the command line, end
all ranks if any rank fails (a traceback, then MPI_Abort: never a hang), and one OK line."""
import sys
import traceback


def run_cases(world, run, cases) -> None:
    """``run(case)`` for each case; any exception on any rank aborts the whole job."""
    try:
        for case in cases:
            run(case)
    except BaseException:
        sys.stderr.write(f"rank {world.rank} failed:\n{traceback.format_exc()}")
        world.abort(1)


def report_ok(world, text: str) -> None:
    """After every rank passed the case: 'OK P=<ranks> <text>' from rank 0."""
    world.barrier()
    if world.rank == 0:
        print(f"OK P={world.size} {text}", flush=True)


def grid_and_split(case: str) -> tuple[list[int], list[int]]:
    """A case ``GRIDxSPLIT`` such as ``12x16:1x2`` as ([12, 16], [1, 2])."""
    grid_s, split_s = case.split(":")
    return [int(v) for v in grid_s.split("x")], [int(v) for v in split_s.split("x")]


def assert_split_matches(dom, total, ref, grad, ref_grad, what: str, rtol: float) -> None:
    """A split's summed value ``total`` equals the undivided ``ref``, and this block's gradient
    summed over the domain's ranks equals ``ref_grad``, relative to its largest entry."""
    import torch

    torch.testing.assert_close(total, ref, rtol=rtol, atol=0, msg=f"{what}: value")
    grad = grad.contiguous()
    dom.allreduce_(grad.view(-1))
    scale = ref_grad.abs().max().item()
    torch.testing.assert_close(grad / scale, ref_grad / scale, rtol=rtol, atol=rtol,
                               msg=f"{what}: gradient")
