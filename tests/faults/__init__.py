"""Fault injection for the test suite: faults in the training loop (:mod:`tests.faults.steps`,
``DEEPFUSION_FAULT`` through the product's one test hook), damaged checkpoint files
(:mod:`tests.faults.files`) and the seeded bit-flip sweep over a checkpoint (``python -m
tests.faults.bitflip``)."""
