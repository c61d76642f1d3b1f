"""Run operations: the run directory's lock, its log (metrics.jsonl), the ETA, stop signals and their watchdog."""
