"""The server's RPC handlers over real P2P daemons (one server peer, one client peer, in this process).

Sessions are checked against the same blocks run locally: steps, step_id de-duplication, start_from_position,
hypo_ids, pushes; the memory pool's hard limit and alloc_timeout; limits; malformed requests; forward (unary and
stream) and backward.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

import pytest
import torch
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from hivekeeper.core.runtime.checkpoint import load_span
from hivekeeper.core.runtime.model import KVCache
from hivekeeper.core.swarm.client.inference import _LoopThread
from hivekeeper.core.swarm.server.handler import ServedSpan, ServingLimits, TransformerConnectionHandler
from hivekeeper.core.swarm.server.memory import MemoryPool
from hivekeeper.core.swarm.protocol import (
    chain_uid,
    deserialize_tensor,
    handler_name,
    pack_args,
    pack_metadata,
    serialize_tensor,
    stream_messages,
    combine_parts,
    unpack_metadata,
)

PREFIX = "tiny"
POOL_TOKENS = 64  # per block, for the whole server


class Rig:
    """A server peer with the handler over blocks [0, 2) and a client peer, on a background loop."""

    def __init__(self, checkpoint):
        self.thread = _LoopThread()
        self.span = load_span(checkpoint, 0, 2)
        self.config = self.span.config
        self.limits = ServingLimits(max_length=48, max_sessions=3, max_request_bytes=8 * 2**20, step_timeout=5.0)
        pool_bytes = KVCache.nbytes_for(self.config, 2, 1, POOL_TOKENS, torch.float32)
        self.run(self._start(pool_bytes))

    def run(self, coro, timeout=60):
        return self.thread.run(coro, timeout)

    async def _start(self, pool_bytes):
        self.server_p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        self.handler = TransformerConnectionHandler(self.server_p2p, MemoryPool(pool_bytes), self.limits)
        await self.handler.add_p2p_handlers(self.server_p2p)
        self.handler.set_span(ServedSpan(self.span, PREFIX, torch.device("cpu")))
        maddrs = [str(a) for a in await self.server_p2p.get_visible_maddrs()]
        self.client_p2p = await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])

    def close(self):
        async def stop():
            await self.client_p2p.shutdown()
            self.handler.close()
            await self.server_p2p.shutdown()

        self.run(stop())
        self.thread.stop()

    # ---- calls ----
    async def unary(self, method, request, response_type=runtime_pb2.ExpertResponse):
        return await self.client_p2p.call_protobuf_handler(self.server_p2p.peer_id, handler_name(method), request,
                                                           response_type)

    def forward(self, uid, *tensors, metadata=None, method="rpc_forward"):
        flat, structure = pack_args(*tensors)
        meta = pack_metadata({"args_structure": structure, **(metadata or {})})
        request = runtime_pb2.ExpertRequest(uid=uid, tensors=[serialize_tensor(t) for t in flat], metadata=meta)
        response = self.run(self.unary(method, request))
        return [deserialize_tensor(t) for t in response.tensors]


class RawSession:
    """An rpc_inference stream driven by hand: step() sends one request and returns the decoded output."""

    def __init__(self, rig: Rig, uid: str = chain_uid(PREFIX, 0, 2), **open_metadata):
        self.rig, self.uid = rig, uid
        self.open_metadata = {"max_length": 32, "session_id": str(uuid.uuid4()), **open_metadata}
        self.inbox = None
        self.responses = None

    async def _open(self):
        self.inbox = asyncio.Queue()

        async def requests():
            while (item := await self.inbox.get()) is not None:
                yield item

        self.responses = await self.rig.client_p2p.iterate_protobuf_handler(
            self.rig.server_p2p.peer_id, handler_name("rpc_inference"), requests(), runtime_pb2.ExpertResponse)

    def send(self, hidden, hypo_ids=None, expect_response=True, raw_request=None, **metadata):
        async def go():
            if self.inbox is None:
                await self._open()
                metadata.update(self.open_metadata)
            hypo = hypo_ids if hypo_ids is not None else torch.empty(0, dtype=torch.int64)
            flat, structure = pack_args(hidden, torch.empty(0), hypo)
            request = raw_request or runtime_pb2.ExpertRequest(
                uid=self.uid, tensors=[serialize_tensor(t) for t in flat],
                metadata=pack_metadata({"args_structure": structure, "step_id": str(uuid.uuid4()), **metadata}))
            self.inbox.put_nowait(request)
            if expect_response:
                response = await asyncio.wait_for(self.responses.__anext__(), 10)
                return deserialize_tensor(response.tensors[0])

        return self.rig.run(go())

    def close(self):
        async def go():
            if self.inbox is not None:
                self.inbox.put_nowait(None)
                await asyncio.wait_for(self.responses.aclose(), 5)

        self.rig.run(go())

    def abandon(self):
        """Drop the stream without ending the session (a client that disappears)."""
        self.rig.run(self.responses.aclose())


@pytest.fixture(scope="module")
def rig(tiny_checkpoint):
    rig = Rig(tiny_checkpoint)
    yield rig
    rig.close()


def wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def local_steps(span, chunks, max_length=32, reorder_before=None):
    """Outputs of span over successive chunks with a local KVCache (optionally reordering rows before step i)."""
    cache = KVCache.allocate(span.config, len(span.blocks), chunks[0].shape[0], max_length)
    outputs = []
    with torch.inference_mode():
        for i, chunk in enumerate(chunks):
            if reorder_before and i in reorder_before:
                cache.reorder(reorder_before[i])
            outputs.append(span(chunk, cache))
    return outputs


def test_rpc_info(rig):
    info = unpack_metadata(rig.run(rig.unary("rpc_info", runtime_pb2.ExpertUID(), runtime_pb2.ExpertInfo))
                           .serialized_info)
    assert info["version"] and info["cache_tokens_available"] == POOL_TOKENS and "forward_schema" not in info
    info = unpack_metadata(rig.run(rig.unary("rpc_info", runtime_pb2.ExpertUID(uid=f"{PREFIX}.1"),
                                             runtime_pb2.ExpertInfo)).serialized_info)
    assert info["inference_schema"][0][2].dtype == torch.int64
    assert info["forward_schema"][0][0].dtype == torch.float32
    with pytest.raises(Exception, match="not served here"):
        rig.run(rig.unary("rpc_info", runtime_pb2.ExpertUID(uid=f"{PREFIX}.7"), runtime_pb2.ExpertInfo))


def test_inference_steps_match_local_blocks_and_dedupe_step_ids(rig):
    torch.manual_seed(0)
    chunks = [torch.randn(1, 5, 64), torch.randn(1, 1, 64), torch.randn(1, 0, 64), torch.randn(1, 1, 64)]
    expected = local_steps(rig.span, chunks)
    session = RawSession(rig)
    try:
        out0 = session.send(chunks[0])
        assert torch.allclose(out0, expected[0], atol=1e-5)
        step_id = str(uuid.uuid4())
        assert torch.allclose(session.send(chunks[1], step_id=step_id), expected[1], atol=1e-5)
        session.send(chunks[1], step_id=step_id, expect_response=False)  # a duplicate: ignored, no answer
        assert session.send(chunks[2]).shape == (1, 0, 64)  # a zero-token step is valid
        assert torch.allclose(session.send(chunks[3]), expected[3], atol=1e-5)
        # rewind to 5 tokens and send the last token again: same answer as the first time
        assert torch.allclose(session.send(chunks[1], start_from_position=5), expected[1], atol=1e-5)
    finally:
        session.close()
    assert wait_until(lambda: rig.handler.pool.used_bytes == 0 and not rig.handler.sessions)


def test_hypo_ids_reorder_the_cached_rows(rig):
    torch.manual_seed(1)
    chunks = [torch.randn(2, 3, 64), torch.randn(2, 1, 64)]
    swap = torch.tensor([1, 0])
    expected = local_steps(rig.span, chunks, reorder_before={1: swap})
    session = RawSession(rig)
    try:
        session.send(chunks[0])
        assert torch.allclose(session.send(chunks[1], hypo_ids=swap), expected[1], atol=1e-5)
        with pytest.raises(Exception, match="hypo_ids must index rows"):
            session.send(chunks[1], hypo_ids=torch.tensor([0, 5]))
    finally:
        session.close()


def test_memory_pool_limit_alloc_timeout_and_return(rig):
    pool = rig.handler.pool
    x = torch.randn(1, 1, 64)
    too_big = RawSession(rig, max_length=POOL_TOKENS + 1)  # fits max_length (48)? no: 65 > 48 is refused first
    with pytest.raises(Exception, match="exceeds this server's limit"):
        too_big.send(x)
    holder = RawSession(rig, max_length=40)
    holder.send(x)
    assert pool.used_bytes == KVCache.nbytes_for(rig.config, 2, 1, 40, torch.float32)
    waiter = RawSession(rig, max_length=40, alloc_timeout=0.3)
    started = time.monotonic()
    with pytest.raises(Exception, match="no room for .* within alloc_timeout=0.3s"):
        waiter.send(x)
    assert time.monotonic() - started >= 0.3
    # a session that fits waits for the holder: it gets the memory once the holder's client disappears
    patient = RawSession(rig, max_length=40, alloc_timeout=10)
    holder.abandon()
    assert torch.isfinite(patient.send(x)).all()
    patient.close()
    assert wait_until(lambda: pool.used_bytes == 0 and not rig.handler.sessions)


def test_session_limits(rig):
    x = torch.randn(1, 1, 64)
    session = RawSession(rig, max_length=4)
    with pytest.raises(Exception, match="exceed the session's max_length 4"):
        session.send(torch.randn(1, 5, 64))
    for bad in ({"max_length": 0}, {"max_length": "12"}, {"max_length": None}, {"alloc_timeout": -1}):
        with pytest.raises(Exception, match="max_length|alloc_timeout"):
            RawSession(rig, **bad).send(x)
    open_sessions = [RawSession(rig, max_length=8) for _ in range(3)]
    for s in open_sessions:
        s.send(x)
    with pytest.raises(Exception, match="server busy"):
        RawSession(rig, max_length=8).send(x)
    for s in open_sessions:
        s.close()
    assert wait_until(lambda: not rig.handler.sessions)


def test_a_session_without_steps_ends_at_the_step_timeout(rig):
    normal = rig.handler.limits
    rig.handler.limits = dataclasses.replace(normal, step_timeout=0.3)
    try:
        session = RawSession(rig, max_length=8)
        started = time.monotonic()  # before the step: the server's wait for the next one starts after answering it
        assert torch.isfinite(session.send(torch.randn(1, 1, 64))).all()
        with pytest.raises(Exception, match="no step within the step timeout of 0.3s"):
            rig.run(asyncio.wait_for(session.responses.__anext__(), 10))
        assert 0.3 <= time.monotonic() - started < 5
        assert wait_until(lambda: rig.handler.pool.used_bytes == 0 and not rig.handler.sessions)
    finally:
        rig.handler.limits = normal


def test_malformed_requests_get_errors_and_the_server_keeps_serving(rig):
    uid = chain_uid(PREFIX, 0, 2)
    hidden = torch.randn(1, 4, 64)

    def raw(uid=uid, tensors=None, metadata=b""):
        tensors = [serialize_tensor(hidden)] if tensors is None else tensors
        return rig.run(rig.unary("rpc_forward", runtime_pb2.ExpertRequest(uid=uid, tensors=tensors,
                                                                          metadata=metadata)))

    cases = {
        "not msgpack": dict(metadata=b"\xc1garbage"),
        "hidden_states must be": dict(tensors=[serialize_tensor(torch.randn(1, 4, 63))]),
        "unsupported tensor dtype": dict(tensors=[runtime_pb2.Tensor(buffer=b"\0" * 8, size=[1], dtype="complex64")]),
        "does not match shape": dict(tensors=[runtime_pb2.Tensor(buffer=b"\0" * 7, size=[1, 1, 64], dtype="float32")]),
        "unknown block uid": dict(uid="other.0 other.1"),
        "not served here": dict(uid=chain_uid(PREFIX, 1, 3)),
        "consecutive": dict(uid=f"{PREFIX}.1 {PREFIX}.0"),
        "names tensor 3": dict(metadata=pack_metadata({"args_structure": ((b"__T3",), {})})),
        "no hidden_states": dict(tensors=[]),
    }
    for message, kwargs in cases.items():
        with pytest.raises(Exception, match=message):
            raw(**kwargs)
    bad_session = RawSession(rig)
    with pytest.raises(Exception, match="hidden_states"):
        bad_session.send(torch.randn(1, 2, 32))
    # still serving, correctly
    (out,) = rig.forward(uid, hidden, torch.empty(0))
    with torch.inference_mode():
        assert torch.allclose(out, rig.span(hidden), atol=1e-5)


def test_forward_stream_and_backward_match_local(rig):
    uid = chain_uid(PREFIX, 0, 2)
    big = torch.randn(6, 1000, 64)  # 1.5 MB: over the unary switch, sent in chunks

    async def stream_forward():
        flat, structure = pack_args(big, torch.empty(0))
        serialized = [serialize_tensor(t) for t in flat]

        async def requests():
            for m in stream_messages(serialized, lambda **kw: runtime_pb2.ExpertRequest(uid=uid, **kw),
                                     pack_metadata({"args_structure": structure})):
                yield m

        responses = await rig.client_p2p.iterate_protobuf_handler(
            rig.server_p2p.peer_id, handler_name("rpc_forward_stream"), requests(), runtime_pb2.ExpertResponse)
        parts = [p async for r in responses for p in r.tensors]
        return [deserialize_tensor(t) for t in combine_parts(parts)]

    (out,) = rig.run(stream_forward())
    with torch.inference_mode():
        assert torch.allclose(out, rig.span(big), atol=1e-4)

    # backward of a sub-chain (block 1 only) with deep prompts
    sub = rig.handler.served.sub(1, 2)
    x, grad, prompts = torch.randn(2, 5, 64), torch.randn(2, 5, 64), torch.randn(1, 2, 3, 64) * 0.1
    grads = rig.forward(chain_uid(PREFIX, 1, 2), x, grad, prompts, method="rpc_backward")
    x_ref, p_ref = x.clone().requires_grad_(True), prompts.clone().requires_grad_(True)
    hidden = torch.cat([x_ref[:, :3] + p_ref[0], x_ref[:, 3:]], dim=1)
    sub(hidden).backward(grad)
    assert torch.allclose(grads[0], x_ref.grad, atol=1e-4) and torch.allclose(grads[1], p_ref.grad, atol=1e-4)
    with pytest.raises(Exception, match="grad_outputs must match"):
        rig.forward(uid, x, torch.randn(2, 4, 64), method="rpc_backward")


def test_pushed_steps_are_served_once(rig):
    torch.manual_seed(2)
    chunks = [torch.randn(1, 3, 64), torch.randn(1, 1, 64)]
    expected = local_steps(rig.span, chunks)
    session = RawSession(rig)
    try:
        session.send(chunks[0])
        step_id = str(uuid.uuid4())
        flat, structure = pack_args(chunks[1], torch.empty(0), torch.empty(0, dtype=torch.int64))
        push = runtime_pb2.ExpertRequest(uid=session.uid, tensors=[serialize_tensor(t) for t in flat],
                                         metadata=pack_metadata({"session_id": session.open_metadata["session_id"],
                                                                 "step_id": step_id, "args_structure": structure}))
        rig.run(rig.unary("rpc_push", push))

        async def next_response():
            return deserialize_tensor((await asyncio.wait_for(session.responses.__anext__(), 10)).tensors[0])

        assert torch.allclose(rig.run(next_response()), expected[1], atol=1e-5)
        # the client's copy of the same step comes later and is skipped; the session goes on from 4 tokens
        session.send(chunks[1], step_id=step_id, expect_response=False)
        follow = session.send(torch.zeros(1, 1, 64))
        assert follow.shape == (1, 1, 64)
        with pytest.raises(Exception, match="unknown session"):
            push.metadata = pack_metadata({"session_id": "nope"})
            rig.run(rig.unary("rpc_push", push))
    finally:
        session.close()
