"""The application: the ``deepfusion`` command, building a run from a config, the error policy
and exit codes, inference / reference solves / comparison, and the fields file format."""
