"""The inference session checks at their limits (docs/testing.md, found by a mutation run), against the real handler
over P2P daemons (test_swarm_handler.py's Rig): the smallest max_length and alloc_timeout accepted, booleans and
strings refused, start_from_position from 0 to the cache's length, a step that fills max_length exactly, and the
position a rewind starts from."""

from __future__ import annotations

import pytest
import torch

from .test_swarm_handler import RawSession, Rig, local_steps

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rig(tiny_checkpoint):
    rig = Rig(tiny_checkpoint)
    yield rig
    rig.close()


def opened(rig, **metadata) -> RawSession:
    """A session whose first step (one token) was answered."""
    session = RawSession(rig, **metadata)
    assert torch.isfinite(session.send(torch.randn(1, 1, 64))).all()
    return session


def test_the_smallest_max_length_and_alloc_timeout_are_accepted_and_non_numbers_refused(rig):
    for good in ({"max_length": 1}, {"max_length": 8, "alloc_timeout": 0}):
        opened(rig, **good).close()
    for bad, message in [({"max_length": True}, "max_length must be a positive int, got True"),
                         ({"max_length": 8, "alloc_timeout": True}, "alloc_timeout must be a number >= 0"),
                         ({"max_length": 8, "alloc_timeout": "1"}, "alloc_timeout must be a number >= 0")]:
        with pytest.raises(Exception, match=message):
            RawSession(rig, **bad).send(torch.randn(1, 1, 64))


def test_start_from_position_goes_from_0_to_the_cache_length(rig):
    torch.manual_seed(4)
    chunks = [torch.randn(1, 4, 64), torch.randn(1, 2, 64)]
    session = RawSession(rig, max_length=16)
    try:
        session.send(chunks[0])
        for bad in (5, -1, True, "2"):
            with pytest.raises(Exception, match=f"start_from_position {bad!r} is outside the session's 4 tokens"):
                session.send(chunks[1], start_from_position=bad)
            session = reopen(rig, session, chunks[0])  # an error ends the session
        expected = local_steps(rig.span, chunks, max_length=16)
        assert torch.allclose(session.send(chunks[1], start_from_position=4), expected[1], atol=1e-5)
        # back to the start: the same as a new session's first step
        assert torch.allclose(session.send(chunks[0], start_from_position=0), expected[0], atol=1e-5)
    finally:
        session.close()


def reopen(rig, session: RawSession, prompt: torch.Tensor) -> RawSession:
    session.close()
    again = RawSession(rig, max_length=16)
    again.send(prompt)
    return again


def test_a_step_may_fill_max_length_exactly_counted_from_a_rewind(rig):
    session = RawSession(rig, max_length=6)
    try:
        session.send(torch.randn(1, 4, 64))
        session.send(torch.randn(1, 4, 64), start_from_position=2)  # 2 + 4 = 6: exactly full
        with pytest.raises(Exception, match="7 tokens exceed the session's max_length 6"):
            session.send(torch.randn(1, 1, 64))
    finally:
        session.close()
