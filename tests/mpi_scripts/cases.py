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
