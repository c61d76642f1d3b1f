"""Several ``deepfusion`` commands in one MPI launch, for tests that compare what commands write
on P ranks (each launch costs every rank ~2 s of imports): ``main(argv)`` for each argv given as
a JSON list on the command line, in order, on every rank. Before each command rank 0 writes a
line ``=== command I`` to stdout and to stderr, after it ``=== exit I CODE`` to stdout, so
``tests.mpi_util.commands`` can cut the output per command. What a launch itself does (its exit
code, start-up, signals) is tested with real ``deepfusion`` launches, not here.

    mpiexec -n 2 python tests/mpi_scripts/commands.py '["infer", ...]' '["solve", ...]'
"""
import json
import sys

from deepfusion.cli import main
from deepfusion.engine.parallel.comm import world


def say(what: str, *streams) -> None:
    for stream in streams:
        print(f"=== {what}", file=stream, flush=True)


if __name__ == "__main__":
    rank0 = world().rank == 0
    for i, arg in enumerate(sys.argv[1:]):
        if rank0:
            say(f"command {i}", sys.stdout, sys.stderr)
        code = main(json.loads(arg))
        if rank0:
            say(f"exit {i} {code}", sys.stdout)
