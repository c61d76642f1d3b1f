"""Problems written the way a user writes one, outside diffnet (tests/test_plugin_problems.py)."""
