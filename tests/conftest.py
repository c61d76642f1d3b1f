"""Fixtures shared by the test files: ``cli`` runs a deepfusion command in the test process;
the ``bench`` marker (the benchmark harness run end to end: ``make test-bench``) and the
``full`` marker (the breadth ``make test`` leaves to ``make test-full``); the files that launch
the most processes run first; each pytest-xdist worker its share of the cores."""
import os

WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if WORKERS > 1:
    # The workers share the cores. With OpenMP's default (every core) an in-process torch or
    # BLAS op oversubscribes them and its threads spin at each barrier for a descheduled one.
    # Set before numpy and torch load (they read it once); a test's own launches set their own.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // WORKERS)))

import pytest  # noqa: E402

from deepfusion.cli import main  # noqa: E402

# pytest-xdist's --dist loadfile gives a worker a whole file, so a long file started last keeps
# one worker busy after the other has run out of files: these start first, in this order (the
# Makefile passes --no-loadscope-reorder, else xdist orders files by their number of tests).
# The two selections hold different shares of the files: FIRST orders `make test`'s (-m "not
# bench and not full"), FIRST_FULL `make test-full`'s (-m full); both longest first.
FIRST = ("test_docs.py", "test_engine_mpi.py", "test_failures.py", "test_domain_train.py",
         "test_checkpoint_faults.py", "test_inference.py", "test_multigrid.py", "test_runlock.py",
         "test_3d.py", "test_prolong.py", "test_stop_signals.py", "test_check_cli.py",
         "test_problems_on_blocks.py", "test_plugin_problems.py", "test_small_faults.py")
FIRST_FULL = ("test_prolong.py", "test_elastic.py", "test_recipes.py", "test_multigrid.py",
              "test_compile.py", "test_docs.py", "test_engine_mpi.py", "test_domain_train.py",
              "test_runlock.py", "test_failures.py", "test_checkpoint_faults.py",
              "test_plugin_problems.py", "test_evaluate.py", "test_trainability.py")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "bench: runs a benchmark harness of bench/ end to end at tiny sizes "
        "(`make test-bench`; `make test` leaves it out)")
    config.addinivalue_line(
        "markers", "full: more of what `make test` already covers once (another P, layout, "
        "recipe, fault or example); `make test-full` runs it, CI runs both")


def pytest_collection_modifyitems(config, items):
    first = FIRST_FULL if config.getoption("markexpr") == "full" else FIRST
    rank = {name: i for i, name in enumerate(first)}
    items.sort(key=lambda item: rank.get(item.path.name, len(first)))  # stable: files stay whole


@pytest.fixture
def cli(monkeypatch, capsys):
    """``deepfusion ARGS`` in this process on the serial communicator (DEEPFUSION_NO_MPI=1;
    a launch with ``env=tests.mpi_util.REAL_MPI`` still gets real MPI): returns
    ``run(args) -> (exit code, stdout, stderr)``. Saves a launch (~1-2 s) per one-rank command."""
    monkeypatch.setenv("DEEPFUSION_NO_MPI", "1")

    def run(args):
        capsys.readouterr()  # drop what the test printed before, so out/err are this command's
        rc = main(args)
        out = capsys.readouterr()
        return rc, out.out, out.err
    return run
