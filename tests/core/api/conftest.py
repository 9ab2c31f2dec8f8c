"""The official `openai` client module for the API tests, imported when one of them runs (or they skip), not when the
suite is collected: `import openai` (its types) costs ~1.7 s of CPU, paid at collection by every pytest-xdist worker,
and at most one worker per file runs these tests."""

import pytest


@pytest.fixture(scope="session")
def openai():
    return pytest.importorskip("openai")
