"""The lab tests reuse the product suite's fixtures."""
from tests.conftest import cli  # noqa: F401
