"""Run operations: the run directory's lock, its log (metrics.jsonl), the ETA, stop signals and their
watchdog, the launcher's keeper (``deepfusion launch``), and the one test-only hook into the
training loop."""
