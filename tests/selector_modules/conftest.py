"""The runtime-backend fixtures of tests/inference/conftest.py, for the selectors' own parity tests."""

from tests.inference.conftest import one_thread, runtime_backend  # noqa: F401
