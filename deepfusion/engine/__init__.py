"""The engine: communicator, thread layout, parallelism, the global step, data, optimisers,
the trainer, checkpoints, evaluation and the run log. It knows no PDE: problems come in
through the contract of ``diffnet.problems.contract.base.Problem``."""
