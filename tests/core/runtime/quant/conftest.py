"""The bitsandbytes module for the int8/nf4 tests, imported when one of them runs (or they skip), not when the suite
is collected: its import cost every pytest-xdist worker ~6 s of CPU, the largest of the whole collection, and only one
worker runs these tests."""

import pytest


@pytest.fixture(scope="session")
def bnb():
    return pytest.importorskip("bitsandbytes")
