"""Fault injection for the test suite: damaged checkpoint files (:mod:`tests.faults.files`) and
the seeded bit-flip sweep over a checkpoint (``python -m tests.faults.bitflip``)."""
