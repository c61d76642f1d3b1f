"""One-off study tools (``python -m lab.tools.NAME``); each one asks one question of trained runs."""
