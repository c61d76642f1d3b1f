"""The application: the commands of ``deepfusion`` (each registers its own parser;
:mod:`deepfusion.cli` builds the command from them), building a run from a config, the error
policy and exit codes, inference / reference solves / comparison, and the fields file format.
Tools outside it (``deepfusion.jobs``) call only :mod:`deepfusion.app.checks`."""
