"""Fuzzing the live handler (test_swarm_handler.py's Rig, real p2p daemons) with random malformed requests from a
separate peer: every RPC, random uids, tensors (dtypes, shapes, buffers, compression types) and metadata (bytes or
msgpack maps of the protocol's keys with random values). After each one the server must have answered (no hang),
a unary error must be one of ours (a TypeError or KeyError escaping a handler is a bug), and a valid forward must
still come back right. Bounded: the suite's derandomized "ci" profile (tests/conftest.py), 40 examples.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from hivekeeper.core.swarm.protocol import chain_uid, handler_name, pack_metadata, serialize_tensor

from .test_swarm_handler import PREFIX, Rig, wait_until

pytestmark = pytest.mark.slow
UID = chain_uid(PREFIX, 0, 2)
OUR_ERRORS = ("ProtocolError", "ServerBusy", "InputError", "AllocationFailed")
UNARY = ["rpc_forward", "rpc_backward", "rpc_push", "rpc_info"]
STREAMED = ["rpc_inference", "rpc_forward_stream", "rpc_backward_stream"]


@pytest.fixture(scope="module")
def rig(tiny_checkpoint):
    rig = Rig(tiny_checkpoint)

    async def attacker():
        maddrs = [str(a) for a in await rig.server_p2p.get_visible_maddrs()]
        return await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])

    rig.attacker = rig.run(attacker())
    yield rig
    rig.run(rig.attacker.shutdown())
    rig.close()


uids = st.one_of(st.just(UID), st.just(f"{PREFIX}.1"), st.text(max_size=12), st.builds(f"{PREFIX}.{{}}".format,
                 st.text(max_size=4)), st.lists(st.integers(-1, 3), max_size=3).map(
                 lambda ix: " ".join(f"{PREFIX}.{i}" for i in ix)))
dtypes = st.sampled_from(["float32", "float16", "bfloat16", "int64", "uint8", "bool", "complex64", "", "float8"])
values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(),
                                st.text(max_size=8), st.binary(max_size=8)),
                      lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                                  max_size=3), max_leaves=8)
keys = st.sampled_from(["max_length", "session_id", "step_id", "alloc_timeout", "args_structure", "next_servers",
                        "start_from_position", "output_compression", "upstream_peer", "pushed", "active_adapter"])
metadata = st.one_of(st.binary(max_size=32), st.dictionaries(keys, values, max_size=5).map(pack_metadata))


@st.composite
def tensors(draw) -> runtime_pb2.Tensor:
    size = draw(st.lists(st.integers(0, 70), max_size=4))
    numel = 1
    for dim in size:
        numel *= dim
    dtype = draw(dtypes)
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8}.get(dtype, 1)
    fitting = numel * itemsize <= 65536
    buffer = draw(st.binary(min_size=numel * itemsize, max_size=numel * itemsize) if fitting and draw(st.booleans())
                  else st.binary(max_size=64))
    return runtime_pb2.Tensor(buffer=buffer, size=size, dtype=dtype, requires_grad=draw(st.booleans()),
                              compression=draw(st.sampled_from(list(runtime_pb2.CompressionType.values()))))


random_requests = st.builds(lambda uid, ts, meta: runtime_pb2.ExpertRequest(uid=uid, tensors=ts, metadata=meta),
                            uids, st.lists(tensors(), max_size=3), metadata)


@st.composite
def near_valid_requests(draw) -> runtime_pb2.ExpertRequest:
    """The right uid and a well-formed hidden_states (plus random extra tensors): random metadata reaches the
    handlers' later checks (sessions, pushes, chains, compression) instead of stopping at the uid."""
    batch, tokens = draw(st.integers(1, 3)), draw(st.integers(0, 4))
    hidden = serialize_tensor(torch.randn(batch, tokens, 64))
    extra = draw(st.lists(tensors(), max_size=2))
    return runtime_pb2.ExpertRequest(uid=UID, tensors=[hidden, *extra],
                                     metadata=pack_metadata(draw(st.dictionaries(keys, values, max_size=5))))


requests = st.one_of(random_requests, near_valid_requests())


async def send(rig: Rig, method: str, request: runtime_pb2.ExpertRequest) -> None:
    peer = rig.server_p2p.peer_id
    if method in UNARY:
        message = runtime_pb2.ExpertUID(uid=request.uid) if method == "rpc_info" else request
        response_type = runtime_pb2.ExpertInfo if method == "rpc_info" else runtime_pb2.ExpertResponse
        await rig.attacker.call_protobuf_handler(peer, handler_name(method), message, response_type)
        return

    async def one():
        yield request

    responses = await rig.attacker.iterate_protobuf_handler(peer, handler_name(method), one(),
                                                            runtime_pb2.ExpertResponse)
    async for _ in responses:
        pass


@given(method=st.sampled_from(UNARY + STREAMED), request=requests)
def test_random_malformed_requests_get_errors_and_the_server_stays_correct(rig, method, request):
    try:
        rig.run(asyncio.wait_for(send(rig, method, request), 10), timeout=30)
    except asyncio.TimeoutError:
        raise AssertionError(f"{method} got no answer within 10 s") from None
    except Exception as exc:  # an error answer: from a unary call it names the exception's class
        if method in UNARY:
            assert str(exc).startswith(OUR_ERRORS), str(exc)[:500]
    hidden = torch.randn(1, 2, 64)
    (out,) = rig.forward(UID, hidden, torch.empty(0))
    with torch.inference_mode():
        assert torch.allclose(out, rig.span(hidden), atol=1e-5)


def test_after_the_fuzzing_nothing_is_held(rig):
    handler = rig.handler
    assert wait_until(lambda: not handler.sessions and handler.pool.used_bytes == 0)
    assert not handler.quotas.requests and handler.quotas.total_bytes == 0 and not handler.quotas.sessions
