"""Prediction: the one pipeline every command and API predicts through, held-out evaluation, refinement by the reference solver, and figures of fields."""
