"""The handler's checks of what a client sends, called in this process on a real handler without P2P daemons: which
blocks a uid chain names, the request size limit, a step's hidden states, deep prompts and hypo_ids, an opening's
session_id and session limit.

test_swarm_handler.py and test_handler_limits.py send the same kinds of requests over real daemons; these tests
state each limit at its edge (one accepted, one refused), which those cannot afford per case. The mutation scope
swarm_handler runs this file first, so most mutants are killed before any daemon starts (docs/testing.md).
"""

from __future__ import annotations

import uuid

import pytest
import torch
from hivemind.proto import runtime_pb2

from hivekeeper.core.runtime.checkpoint import load_span
from hivekeeper.core.runtime.demo_model import make_demo_checkpoint
from hivekeeper.core.swarm.protocol import (
    ProtocolError,
    ServerBusy,
    chain_uid,
    pack_args,
    pack_metadata,
    serialize_tensor,
)
from hivekeeper.core.swarm.server.handler import ServedSpan, ServingLimits, TransformerConnectionHandler
from hivekeeper.core.swarm.server.memory import MemoryPool

PREFIX = "five"
START, END = 1, 4  # the served blocks of a 5-block model: neither edge is the model's
HIDDEN = 64


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> ServedSpan:
    checkpoint = make_demo_checkpoint(tmp_path_factory.mktemp("five") / "m", layers=5, hidden=HIDDEN)
    return ServedSpan(load_span(checkpoint, START, END), PREFIX, torch.device("cpu"))


def make_handler(served: ServedSpan | None, **limits) -> TransformerConnectionHandler:
    """A handler as the server builds it, without a P2P daemon: the checks never reach the network."""
    handler = TransformerConnectionHandler(None, MemoryPool(2**20), ServingLimits(**limits))
    handler.set_span(served)
    return handler


@pytest.fixture
def handler(served):
    handler = make_handler(served)
    yield handler
    handler.close()


def wire(*tensors: torch.Tensor) -> tuple[list[runtime_pb2.Tensor], dict]:
    """The tensors and args_structure a client sends for these positional arguments."""
    flat, structure = pack_args(*tensors)
    return [serialize_tensor(t) for t in flat], {"args_structure": structure}


def hidden(batch: int = 2, tokens: int = 3) -> torch.Tensor:
    return torch.randn(batch, tokens, HIDDEN)


def test_a_handler_without_a_span_refuses_and_one_with_a_span_serves_it(served):
    idle = make_handler(None)
    try:
        with pytest.raises(ProtocolError, match="not serving blocks right now"):
            idle._require_served()
        idle.set_span(served)
        assert idle._require_served() is served
    finally:
        idle.close()


def test_a_uid_chain_must_be_a_run_of_served_blocks(handler, served):
    assert handler._chain(chain_uid(PREFIX, 1, 4), served) == (1, 4)
    assert handler._chain(chain_uid(PREFIX, 2, 3), served) == (2, 3)  # one block inside
    assert handler._chain(chain_uid(PREFIX, 3, 4), served) == (3, 4)  # the last block
    for uid in (f"{PREFIX}.1 {PREFIX}.3", f"{PREFIX}.2 {PREFIX}.1", f"{PREFIX}.2 {PREFIX}.2"):
        with pytest.raises(ProtocolError, match="is not a run of consecutive blocks"):
            handler._chain(uid, served)
    for start, end in ((0, 2), (3, 5), (0, 5)):
        with pytest.raises(ProtocolError, match=f"blocks {start}:{end} are not served here .*serves 1:4"):
            handler._chain(chain_uid(PREFIX, start, end), served)
    with pytest.raises(ProtocolError, match="unknown block uid"):
        handler._chain(chain_uid("other", 1, 2), served)


def test_a_request_may_carry_exactly_the_byte_limit(served):
    tensors, metadata = wire(hidden(1, 2))
    size = sum(len(t.buffer) for t in tensors)
    at_limit = make_handler(served, max_request_bytes=size)
    below = make_handler(served, max_request_bytes=size - 1)
    try:
        (decoded,) = at_limit._decode(tensors, metadata)
        assert decoded.shape == (1, 2, HIDDEN)
        with pytest.raises(ProtocolError, match=f"request of {size} bytes exceeds the limit of {size - 1}"):
            below._decode(tensors, metadata)
    finally:
        at_limit.close()
        below.close()


def test_a_parsed_step_keeps_hidden_prompts_and_hypo_ids(handler, served):
    """Blocks 2:4 (two), batch 2, three tokens, a deep prompt of five tokens, rows swapped; int32 hypo_ids become
    int64."""
    x, prompts, hypo = hidden(2, 3), torch.randn(2, 2, 5, HIDDEN), torch.tensor([1, 0], dtype=torch.int32)
    tensors, metadata = wire(x, prompts, hypo)
    step = handler._parse_step(tensors, metadata, served, 2, 4, batch=2)
    assert torch.equal(step.hidden, x) and torch.equal(step.prompts, prompts)
    assert step.hypo_ids.dtype == torch.int64 and step.hypo_ids.tolist() == [1, 0]
    with pytest.raises(ProtocolError, match="batch 2 does not match the session's batch 3"):
        handler._parse_step(tensors, metadata, served, 2, 4, batch=3)
    with pytest.raises(ProtocolError, match=r"prompts must be \[3, batch, prefix, 64\]"):
        handler._parse_step(tensors, metadata, served, 1, 4)  # three blocks need three prompts


def test_a_step_without_prompts_or_hypo_ids_has_none(handler, served):
    x = hidden(1, 1)
    for args in ((x,), (x, torch.empty(0)), (x, torch.empty(0), torch.empty(0, dtype=torch.int64))):
        step = handler._check_step(args, served, START, END)
        assert step.hidden is x and step.prompts is None and step.hypo_ids is None
    step = handler._check_step((x, None, torch.tensor([0])), served, START, END)  # hypo_ids without prompts
    assert step.prompts is None and step.hypo_ids.tolist() == [0]


def test_hidden_states_must_be_a_float_batch_of_the_models_width(handler, served):
    for args in ((), ("not a tensor",), (None, hidden())):
        with pytest.raises(ProtocolError, match="carries no hidden_states tensor"):
            handler._check_step(args, served, START, END)
    for bad in (torch.randn(3, HIDDEN), torch.randn(1, 2, 3, HIDDEN), torch.randn(2, 3, HIDDEN + 1),
                torch.randn(2, HIDDEN, 3), torch.ones(2, 3, HIDDEN, dtype=torch.int64)):
        with pytest.raises(ProtocolError, match=r"hidden_states must be a float tensor \[batch, tokens, 64\]"):
            handler._check_step((bad,), served, START, END)
    with pytest.raises(ProtocolError, match="batch 0 does not match"):
        handler._check_step((torch.randn(0, 3, HIDDEN),), served, START, END)
    # a batch of one, and a step of no tokens (the batch is what the session holds rows for)
    assert handler._check_step((hidden(1, 3),), served, START, END, batch=1).hidden.shape == (1, 3, HIDDEN)
    assert handler._check_step((torch.randn(3, 0, HIDDEN),), served, START, END, batch=3).hidden.shape[1] == 0
    with pytest.raises(ProtocolError, match="batch 2 does not match the session's batch 3"):
        handler._check_step((hidden(2, 3),), served, START, END, batch=3)


def test_deep_prompts_must_be_one_per_block_and_row_of_the_models_width(handler, served):
    """Blocks 1:4 are three; batch 2, three tokens; the prompt prefix (any length) is its third axis."""
    x = hidden(2, 3)
    good = torch.randn(3, 2, 5, HIDDEN)
    assert torch.equal(handler._check_step((x, good), served, 1, 4).prompts, good)
    for bad in (torch.randn(3, 2, HIDDEN), torch.randn(3, 2, 5, HIDDEN, 1), torch.randn(2, 2, 5, HIDDEN),
                torch.randn(5, 2, 5, HIDDEN), torch.randn(3, 3, 5, HIDDEN), torch.randn(3, 2, 5, HIDDEN + 1),
                torch.randn(2, 3, 5, HIDDEN)):
        with pytest.raises(ProtocolError, match=r"prompts must be \[3, batch, prefix, 64\]"):
            handler._check_step((x, bad), served, 1, 4)
    with pytest.raises(ProtocolError, match="prompts must be a float tensor"):
        handler._check_step((x, torch.ones(3, 2, 5, HIDDEN, dtype=torch.int32)), served, 1, 4)


def test_hypo_ids_must_index_rows_of_the_batch(handler, served):
    """Batch 3 over four tokens (so that a check of the wrong axis shows): every row index 0..2 is accepted."""
    x = hidden(3, 4)
    for ids in ([0, 1, 2], [2, 2, 2], [0, 0, 0]):
        step = handler._check_step((x, None, torch.tensor(ids)), served, START, END)
        assert step.hypo_ids.tolist() == ids
    for bad in (torch.tensor([0.0, 1.0, 2.0]), torch.tensor([0, 1], dtype=torch.int64),
                torch.tensor([0, 1, 2, 0]), torch.tensor([[0, 1, 2]]), torch.tensor([0, 1, 2], dtype=torch.int16)):
        with pytest.raises(ProtocolError, match=r"hypo_ids must be int64 \[3\]"):
            handler._check_step((x, None, bad), served, START, END)
    for bad in ([-1, 0, 1], [0, 1, 3], [3, 0, 1]):
        with pytest.raises(ProtocolError, match="hypo_ids must index rows of the batch"):
            handler._check_step((x, None, torch.tensor(bad)), served, START, END)


def opening(session_id=None, **metadata) -> runtime_pb2.ExpertRequest:
    tensors, structure = wire(hidden(1, 1))
    meta = {"max_length": 8, **structure, **metadata}
    if session_id is not None:
        meta["session_id"] = session_id
    return runtime_pb2.ExpertRequest(uid=chain_uid(PREFIX, 1, 4), tensors=tensors, metadata=pack_metadata(meta))


def test_an_opening_keeps_a_short_session_id_and_replaces_an_odd_one_with_a_fresh_uuid(handler):
    for kept in ("s", "s" * 256):
        assert handler._check_opening(opening(kept)).session_id == kept
    replaced = [handler._check_opening(opening(odd)).session_id for odd in (None, "", "s" * 257, 7)]
    assert all(str(uuid.UUID(sid)) == sid for sid in replaced)  # a real uuid each (not "None")
    assert len(set(replaced)) == len(replaced)


def test_an_opening_beyond_the_session_limit_is_told_the_server_is_busy(served):
    full = make_handler(served, max_sessions=0)
    try:
        with pytest.raises(ServerBusy, match=r"0 sessions open \(limit 0\)"):
            full._check_opening(opening("s"))
    finally:
        full.close()
