"""Fixtures shared by the test files: ``cli`` runs a deepfusion command in the test process."""
import pytest

from deepfusion.app.cli import main


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
