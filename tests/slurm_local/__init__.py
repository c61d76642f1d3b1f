"""A throw-away one-node Slurm cluster on localhost, to run the job scripts under a real scheduler.

    python -m tests.slurm_local run [-- PYTEST_ARGS...]   # what `make test-slurm` runs
    python -m tests.slurm_local check                     # can this machine run it? (says why not)

* :mod:`.cluster` owns the lifecycle: decide whether the machine allows it, install Slurm and
  munge from the OS packages, write slurm.conf into a temporary directory, start munged,
  slurmctld and slurmd, wait for the node, and stop every daemon it started, by PID.
* :mod:`.client` owns waiting for a running cluster's jobs from tests, with a timeout that
  fails with a clear message (sbatch and job states are the product's
  :mod:`deepfusion.jobs.slurm`).
* :mod:`.__main__` is the command line above.
"""
