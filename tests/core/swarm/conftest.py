"""Fixtures for the swarm tests: the tiny demo checkpoint's two blocks loaded as one local span, the reference
that a swarm session's outputs are compared with (one definition for every swarm test module that needs it)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def span(tiny_checkpoint):
    """Blocks 0 and 1 of the tiny demo checkpoint as one local span (per module: a test may step its caches)."""
    from hivekeeper.core.runtime.checkpoint import load_span

    return load_span(tiny_checkpoint, 0, 2)
