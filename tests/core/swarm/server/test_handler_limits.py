"""The inference session checks at their limits (docs/testing.md, found by a mutation run), against the real handler
over P2P daemons (test_swarm_handler.py's Rig): the smallest max_length and alloc_timeout accepted, booleans and
strings refused, start_from_position from 0 to the cache's length, a step that fills max_length exactly, the
position a rewind starts from, a step's batch and deep prompts' shape."""

from __future__ import annotations

import uuid

import pytest
import torch
from hivemind.proto import runtime_pb2

from hivekeeper.core.swarm.protocol import pack_args, pack_metadata, serialize_tensor

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
    for good in ({"max_length": 1}, {"max_length": rig.limits.max_length}, {"max_length": 8, "alloc_timeout": 0}):
        opened(rig, **good).close()
    for bad, message in [({"max_length": 0}, "max_length must be a positive int, got 0"),
                         ({"max_length": True}, "max_length must be a positive int, got True"),
                         ({"max_length": 8, "alloc_timeout": True}, "alloc_timeout must be a number >= 0"),
                         ({"max_length": 8, "alloc_timeout": "1"}, "alloc_timeout must be a number >= 0")]:
        with pytest.raises(Exception, match=message):
            RawSession(rig, **bad).send(torch.randn(1, 1, 64))


def test_an_upstream_peer_or_step_id_that_is_not_a_short_string_is_refused_when_the_session_opens(rig):
    """upstream_peer names the only peer allowed to push into the session (docs/swarm.md); a number, an empty or an
    over-long name is refused with one error naming the field (sessions without one: the tests above); so is the
    first step's step_id."""
    for bad in (5, "", "p" * 257):
        with pytest.raises(Exception, match="upstream_peer must be a string of 1 to 256 characters"):
            RawSession(rig, max_length=8, upstream_peer=bad).send(torch.randn(1, 1, 64))
    with pytest.raises(Exception, match="step_id must be a string of 1 to 256 characters"):
        RawSession(rig, max_length=8).send(torch.randn(1, 1, 64), step_id=5)  # the first step's id too


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


def test_a_step_must_keep_the_sessions_batch_and_its_prompts_the_spans_shape(rig):
    session = RawSession(rig, max_length=16)
    try:
        with pytest.raises(Exception, match="hidden_states batch 0 does not match"):
            session.send(torch.randn(0, 1, 64))
        session = RawSession(rig, max_length=16)
        session.send(torch.randn(1, 2, 64))
        with pytest.raises(Exception, match="hidden_states batch 2 does not match the session's batch 1"):
            session.send(torch.randn(2, 1, 64))
        # deep prompts: one [batch, prefix, hidden] per block of the span (blocks 0 and 1 here)
        session = RawSession(rig, max_length=16)
        with pytest.raises(Exception, match=r"prompts must be \[2, batch, prefix, 64\], got \[3, 1, 1, 64\]"):
            session.send(torch.randn(1, 1, 64), raw_request=step_with_prompts(session, torch.randn(3, 1, 1, 64)))
    finally:
        session.close()


def step_with_prompts(session: RawSession, prompts: torch.Tensor):
    """An opening request whose step carries deep prompts (Petals' prompt tuning)."""
    flat, structure = pack_args(torch.randn(1, 1, 64), prompts, torch.empty(0, dtype=torch.int64))
    metadata = {"args_structure": structure, "step_id": str(uuid.uuid4()), **session.open_metadata}
    return runtime_pb2.ExpertRequest(uid=session.uid, tensors=[serialize_tensor(t) for t in flat],
                                     metadata=pack_metadata(metadata))
