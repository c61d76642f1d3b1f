"""A plugin module that cannot be imported: its own import fails (tests/test_plugin_problems.py)."""
import a_module_that_is_not_installed  # noqa: F401
