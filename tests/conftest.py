"""Test-session settings: a private mobc cache so tests never read or fill the user's ~/.cache/mobc."""

import os
import tempfile

import pytest


@pytest.fixture(scope="session", autouse=True)
def _private_mobc_cache():
    if "MOBC_TEST_USE_USER_CACHE" in os.environ:  # opt-in reuse of the GGUF float cache
        yield
        return
    with tempfile.TemporaryDirectory(prefix="mobc-cache-") as folder:
        old = os.environ.get("MOBC_CACHE")
        os.environ["MOBC_CACHE"] = folder
        yield
        if old is None:
            os.environ.pop("MOBC_CACHE", None)
        else:
            os.environ["MOBC_CACHE"] = old
