"""Issue 17's attacks on one live handler (test_swarm_handler.py's Rig: a server peer over real p2p daemons) from
separate attacking hivemind peers: each attack is refused the way docs/swarm.md "Limits" says, and the server then
answers a legitimate request correctly.

The compute thread is held (a task that waits on an Event) where a test needs work to queue up, so nothing here
depends on the machine's speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import uuid

import pytest
import torch
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from hivekeeper.core.swarm.protocol import (
    MAX_METADATA_BYTES,
    MAX_STREAM_MESSAGE_BYTES,
    chain_uid,
    deserialize_tensor,
    handler_name,
    is_busy,
    pack_args,
    pack_metadata,
    serialize_tensor,
)
from hivekeeper.core.swarm.server.compute import FORWARD
from hivekeeper.core.swarm.server.handler import FORWARD_TASK_ROWS, run_blocks
from hivekeeper.core.swarm.server.quotas import Quotas

from .test_swarm_handler import PREFIX, RawSession, Rig, local_steps, wait_until

pytestmark = pytest.mark.slow
UID = chain_uid(PREFIX, 0, 2)


@pytest.fixture(scope="module")
def rig(tiny_checkpoint):
    rig = Rig(tiny_checkpoint)
    rig.attackers = [rig.run(_peer(rig)) for _ in range(2)]  # two more peers besides rig.client_p2p
    yield rig
    async def stop():
        await asyncio.gather(*(p.shutdown() for p in rig.attackers))

    rig.run(stop())
    rig.close()


async def _peer(rig: Rig) -> P2P:
    maddrs = [str(a) for a in await rig.server_p2p.get_visible_maddrs()]
    return await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])


@contextlib.contextmanager
def limits(rig: Rig, **changes):
    """The handler under other limits (quotas included) for the body."""
    normal, quotas = rig.handler.limits, rig.handler.quotas
    rig.handler.limits = dataclasses.replace(normal, **changes)
    rig.handler.quotas = Quotas(rig.handler.limits.quotas())
    try:
        yield
    finally:
        rig.handler.limits, rig.handler.quotas = normal, quotas


@contextlib.contextmanager
def compute_held(rig: Rig):
    """The compute thread busy until the body ends: work sent meanwhile queues up."""
    release = threading.Event()
    rig.handler.compute.submit(FORWARD, release.wait, 30)
    try:
        yield
    finally:
        release.set()


def forward_request(hidden: torch.Tensor, compression=runtime_pb2.CompressionType.NONE, **metadata):
    flat, structure = pack_args(hidden, torch.empty(0))
    return runtime_pb2.ExpertRequest(uid=UID, tensors=[serialize_tensor(t, compression) for t in flat],
                                     metadata=pack_metadata({"args_structure": structure, **metadata}))


async def call(p2p: P2P, rig: Rig, method: str, request):
    return await p2p.call_protobuf_handler(rig.server_p2p.peer_id, handler_name(method), request,
                                           runtime_pb2.ExpertResponse)


def assert_still_serving(rig: Rig):
    hidden = torch.randn(1, 3, 64)
    (out,) = rig.forward(UID, hidden, torch.empty(0))
    with torch.inference_mode():
        assert torch.allclose(out, rig.span(hidden), atol=1e-5)


def test_a_unary_response_over_the_cap_is_refused_at_once_and_leaves_no_task(rig):
    # 2 MiB of float16 in, 4 MiB of float32 out: over p2pd's unary cap, which hivemind could neither send nor free
    hidden = torch.randn(16, 1024, 64).half()
    tasks = rig.server_p2p._client.control._handler_tasks  # hivemind's pending unary handlers
    with pytest.raises(Exception, match="exceeds the unary limit of 4194304 bytes; call rpc_forward_stream"):
        rig.run(call(rig.attackers[0], rig, "rpc_forward", forward_request(hidden, runtime_pb2.CompressionType.FLOAT16)))
    assert wait_until(lambda: not tasks)
    assert not rig.handler.quotas.bytes and not rig.handler.quotas.requests  # its bytes were returned
    assert_still_serving(rig)


def test_a_stream_message_announcing_too_many_bytes_is_dropped_before_its_body(rig):
    async def announce_300_mib():
        _, reader, writer = await rig.attackers[0].call_binary_stream_handler(
            rig.server_p2p.peer_id, handler_name("rpc_forward_stream"))
        writer.write(P2P.MESSAGE_MARKER + (300 * 2**20).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"\0" * 1024)
        await writer.drain()
        try:  # the server closes the stream; without the header check it would wait for 300 MiB
            return await asyncio.wait_for(reader.read(), 10)
        finally:
            writer.close()

    assert 300 * 2**20 > MAX_STREAM_MESSAGE_BYTES
    assert rig.run(announce_300_mib()) == b""
    assert_still_serving(rig)


def test_metadata_over_its_cap_is_refused_before_unpacking(rig):
    request = forward_request(torch.randn(1, 2, 64))
    request.metadata = pack_metadata({"padding": "x" * MAX_METADATA_BYTES})
    with pytest.raises(Exception, match=f"bytes exceeds the limit of {MAX_METADATA_BYTES}"):
        rig.run(call(rig.attackers[0], rig, "rpc_forward", request))
    assert_still_serving(rig)


def test_unread_steps_stop_at_the_inbox_bound_and_are_then_answered_in_order(rig):
    torch.manual_seed(5)
    chunks = [torch.randn(1, 1, 64) for _ in range(12)]  # 1 running + 8 in the inbox + the rest in the stream
    expected = local_steps(rig.span, chunks)
    session = RawSession(rig)
    try:
        with compute_held(rig):
            session.send(chunks[0], expect_response=False)
            for chunk in chunks[1:]:
                session.send(chunk, expect_response=False)
            sid = session.open_metadata["session_id"]
            assert wait_until(lambda: sid in rig.handler.sessions)
            live = rig.handler.sessions[sid]
            bound = rig.handler.limits.max_unread_steps
            assert wait_until(lambda: live.inbox.qsize() == bound)  # the other steps wait in the stream
            with pytest.raises(Exception, match="server busy: the session has 8 unread steps"):
                rig.run(call(rig.attackers[0], rig, "rpc_push", push(session, chunks[0])))
        for want in expected:
            got = rig.run(asyncio.wait_for(session.responses.__anext__(), 10))
            assert torch.allclose(deserialize_tensor(got.tensors[0]), want, atol=1e-5)
    finally:
        session.close()


def push(session: RawSession, hidden: torch.Tensor, **metadata) -> runtime_pb2.ExpertRequest:
    flat, structure = pack_args(hidden, torch.empty(0), torch.empty(0, dtype=torch.int64))
    meta = {"session_id": session.open_metadata["session_id"], "step_id": str(uuid.uuid4()),
            "args_structure": structure, **metadata}
    return runtime_pb2.ExpertRequest(uid=session.uid, tensors=[serialize_tensor(t) for t in flat],
                                     metadata=pack_metadata(meta))


def test_sessions_per_peer_are_capped_and_other_peers_still_get_theirs(rig):
    with limits(rig, max_sessions_per_peer=2):
        held = [RawSession(rig, max_length=8) for _ in range(2)]
        for session in held:
            session.send(torch.randn(1, 1, 64))
        with pytest.raises(Exception) as refused:
            RawSession(rig, max_length=8).send(torch.randn(1, 1, 64))
        assert is_busy(refused.value) and "holds 2 inference sessions here (limit 2 per peer)" in str(refused.value)
        for session in held:
            session.close()
    assert wait_until(lambda: not rig.handler.sessions and not rig.handler.quotas.sessions)


def test_forwards_in_flight_are_capped_per_peer_and_in_bytes_for_all(rig):
    hidden = torch.randn(1, 64, 64)  # 16 KiB
    nbytes = hidden.numel() * 4

    async def flood():
        first = [asyncio.create_task(call(rig.attackers[0], rig, "rpc_forward", forward_request(hidden)))
                 for _ in range(2)]
        await asyncio.sleep(0)
        while rig.handler.quotas.requests[str(rig.attackers[0].peer_id)] < 2:
            await asyncio.sleep(0.01)
        refusals = await asyncio.gather(
            call(rig.attackers[0], rig, "rpc_forward", forward_request(hidden)),  # a third from the same peer
            call(rig.attackers[1], rig, "rpc_forward", forward_request(hidden)),  # over the bytes for all
            return_exceptions=True)
        return first, refusals

    with limits(rig, max_inflight_bytes=2 * nbytes + 1024), compute_held(rig):
        quotas = rig.handler.quotas
        first, refusals = rig.run(flood())
    assert all(is_busy(r) for r in refusals), refusals
    assert "2 forward/backward requests in flight (limit 2 per peer)" in str(refusals[0])
    assert f"(limit {2 * nbytes + 1024} for all peers)" in str(refusals[1])
    for task in first:  # the two admitted ones are answered once compute is free
        (out,) = rig.run(asyncio.wait_for(task, 20)).tensors
        with torch.inference_mode():
            assert torch.allclose(deserialize_tensor(out), rig.span(hidden), atol=1e-5)
    assert not quotas.bytes and quotas.total_bytes == 0 and not quotas.requests


def test_a_step_is_not_run_inline_on_a_shape_never_measured(rig):
    """A batch-16 session opened with 0 tokens: its 1-token step is 16 rows, never timed, so it goes to the compute
    thread (it used to run on the event loop, trusting the 0-token step's time)."""
    session = RawSession(rig, max_length=4)
    before = rig.handler.inline_steps
    try:
        assert session.send(torch.randn(16, 0, 64)).shape == (16, 0, 64)
        assert session.send(torch.randn(16, 1, 64)).shape == (16, 1, 64)
        assert rig.handler.inline_steps == before + 1  # the 0-token step only: no rows, nothing to wait for
    finally:
        session.close()


def test_pushes_come_only_from_the_sessions_upstream_peer(rig):
    torch.manual_seed(6)
    chunks = [torch.randn(1, 2, 64), torch.randn(1, 1, 64)]
    expected = local_steps(rig.span, chunks)
    upstream, attacker = rig.attackers
    session = RawSession(rig, upstream_peer=upstream.peer_id.to_base58())
    try:
        session.send(chunks[0])
        with pytest.raises(Exception, match="push refused: this session takes pushes only from the upstream peer "
                                            "the client named"):
            rig.run(call(attacker, rig, "rpc_push", push(session, torch.randn(1, 1, 64) * 10)))
        assert torch.allclose(session.send(chunks[1]), expected[1], atol=1e-5)  # the foreign step never ran
        rig.run(call(upstream, rig, "rpc_push", push(session, chunks[1], start_from_position=2)))
        pushed = rig.run(asyncio.wait_for(session.responses.__anext__(), 10))
        assert torch.allclose(deserialize_tensor(pushed.tensors[0]), expected[1], atol=1e-5)
    finally:
        session.close()
    # no upstream named (Petals clients): the first pusher is the upstream
    session = RawSession(rig)
    try:
        session.send(chunks[0])
        rig.run(call(upstream, rig, "rpc_push", push(session, chunks[1])))
        with pytest.raises(Exception, match="only from the upstream peer that pushed first"):
            rig.run(call(attacker, rig, "rpc_push", push(session, chunks[1])))
    finally:
        session.close()


def test_push_chains_are_bounded_and_need_step_ids(rig):
    session = RawSession(rig)
    try:
        session.send(torch.randn(1, 1, 64))
        peer, sid = rig.server_p2p.peer_id.to_base58(), session.open_metadata["session_id"]
        loop = tuple((peer, sid, 0, 2) for _ in range(33))
        for bad, message in [({"next_servers": loop}, "next_servers must be a list of at most 32 servers"),
                             ({"step_id": None}, "a pushed step's step_id must be a string"),
                             ({"next_servers": (("p", "s", 0),)}, "next_servers entries must be"),
                             ({"session_id": [1, 2]}, "session_id must be a string")]:
            with pytest.raises(Exception, match=message):
                rig.run(call(rig.client_p2p, rig, "rpc_push", push(session, torch.randn(1, 1, 64), **bad)))
        with pytest.raises(Exception, match="next_servers must be a list of at most 32"):
            session.send(torch.randn(1, 1, 64), next_servers=loop)
    finally:
        session.close()
    assert_still_serving(rig)


def test_odd_ids_and_uids_get_short_clear_errors(rig):
    for uid in (f"{PREFIX}.\u0661", f"{PREFIX}.\u00b2", f"{PREFIX}." + "9" * 7, "x" * 100_000):
        request = forward_request(torch.randn(1, 2, 64))
        request.uid = uid
        with pytest.raises(Exception) as refused:
            rig.run(call(rig.attackers[0], rig, "rpc_forward", request))
        assert "unknown block uid" in str(refused.value) or "exceeds the limit" in str(refused.value)
        assert len(str(refused.value)) < 400  # the uid is clipped, not echoed whole
    for step_id in ([1], {"a": 1}, "s" * 300):
        session = RawSession(rig)
        with pytest.raises(Exception, match="step_id must be a string"):
            session.send(torch.randn(1, 1, 64), step_id=step_id)
    assert_still_serving(rig)


def test_a_session_timeout_is_reported_as_such(rig):
    with limits(rig, session_timeout=0.3, step_timeout=5.0):
        session = RawSession(rig, max_length=8)
        session.send(torch.randn(1, 1, 64))
        with pytest.raises(Exception, match="session exceeded the server's session timeout of 0.3s"):
            rig.run(asyncio.wait_for(session.responses.__anext__(), 10))
    assert wait_until(lambda: not rig.handler.sessions)


def test_blockwise_8bit_in_and_out_through_the_handler(rig):
    hidden = torch.randn(2, 5, 64)
    blockwise = runtime_pb2.CompressionType.BLOCKWISE_8BIT
    request = forward_request(hidden, blockwise, output_compression=(blockwise,))
    (out,) = rig.run(call(rig.attackers[0], rig, "rpc_forward", request)).tensors
    assert out.compression == blockwise
    with torch.inference_mode():
        reference = rig.span(deserialize_tensor(request.tensors[0]))
    assert torch.allclose(deserialize_tensor(out), reference, atol=0.05 * reference.abs().max().item())


def test_a_forward_split_into_block_and_row_tasks_matches_the_whole_span(rig):
    """Forwards run as tasks of one block and at most FORWARD_TASK_ROWS rows, so an inference step waits for one
    task; the pieces, deep prompts included, add up to the span run in one go."""
    torch.manual_seed(7)
    hidden, prompts = torch.randn(3, 1000, 64), torch.randn(2, 3, 5, 64) * 0.1  # 2 sequences per task
    assert FORWARD_TASK_ROWS // 1000 < hidden.shape[0]
    (out,) = rig.forward(UID, hidden, prompts)
    with torch.inference_mode():
        assert torch.allclose(out, run_blocks(rig.span, hidden, None, prompts), atol=1e-4)
