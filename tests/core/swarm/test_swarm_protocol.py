"""The Petals wire format: packed arguments, metadata, tensors (bf16 both ways), streaming chunks, uids, schemas."""

from __future__ import annotations

import pytest
import torch
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.tensor_descr import BatchTensorDescriptor

from hivekeeper.core.swarm.protocol import (
    ProtocolError,
    block_schemas,
    chain_uid,
    combine_parts,
    deserialize_tensor,
    pack_args,
    pack_metadata,
    parse_chain_uid,
    push_request,
    schema_dtypes,
    serialize_tensor,
    split_for_streaming,
    stream_messages,
    unpack_args,
    unpack_metadata,
)


def test_pack_args_marks_tensors_and_round_trips_through_msgpack():
    hidden, prompts, hypo = torch.randn(2, 3, 4), torch.empty(0), torch.tensor([1, 0])
    tensors, structure = pack_args(hidden, prompts, hypo, flag=True)
    assert [t is x for t, x in zip(tensors, (hidden, prompts, hypo))] == [True, True, True]
    assert structure == ((b"__T0", b"__T1", b"__T2"), {"flag": True})
    wire = MSGPackSerializer.loads(MSGPackSerializer.dumps(structure))  # tuples survive (ext 0x40)
    args, kwargs = unpack_args(tensors, wire)
    assert args[0] is hidden and args[2] is hypo and kwargs == {"flag": True}


def test_pack_args_sends_a_repeated_tensor_once():
    x = torch.ones(2)
    tensors, structure = pack_args(x, x)
    assert len(tensors) == 1 and structure == ((b"__T0", b"__T0"), {})


def test_unpack_without_structure_and_with_bad_structures():
    tensors = [torch.zeros(1), torch.ones(1)]
    assert unpack_args(tensors, None) == (tuple(tensors), {})
    with pytest.raises(ProtocolError, match="names tensor 5"):
        unpack_args(tensors, ((b"__T5",), {}))
    with pytest.raises(ProtocolError, match="pair"):
        unpack_args(tensors, [b"__T0"])


def test_metadata_round_trip_and_errors():
    meta = {"max_length": 128, "session_id": "abc", "next_servers": (("peer", "s", 0, 2),)}
    assert unpack_metadata(pack_metadata(meta)) == meta
    assert unpack_metadata(b"") == {}
    with pytest.raises(ProtocolError, match="not msgpack"):
        unpack_metadata(b"\xc1\xc1\xc1")
    with pytest.raises(ProtocolError, match="msgpack map"):
        unpack_metadata(MSGPackSerializer.dumps([1, 2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.bfloat16, torch.bool])
def test_tensor_round_trip_writes_hivemind_bytes(dtype):
    from hivemind.compression import serialize_torch_tensor

    x = (torch.randn(3, 5) * 10).to(dtype)
    assert torch.equal(deserialize_tensor(serialize_tensor(x)), x)
    assert serialize_tensor(x).SerializeToString() == serialize_torch_tensor(x).SerializeToString()
    grad = torch.randn(2, requires_grad=True)
    assert serialize_tensor(grad).SerializeToString() == serialize_torch_tensor(grad).SerializeToString()


def test_bfloat16_is_accepted_raw_and_in_the_legacy_float32_form():
    x = torch.randn(4, 6).to(torch.bfloat16)
    raw = runtime_pb2.Tensor(buffer=x.view(torch.int16).numpy().tobytes(), size=x.shape, dtype="bfloat16")
    legacy = runtime_pb2.Tensor(buffer=x.float().numpy().tobytes(), size=x.shape, dtype="bfloat16")
    assert len(legacy.buffer) == 2 * len(raw.buffer)
    for message in (raw, legacy):
        y = deserialize_tensor(message)
        assert y.dtype == torch.bfloat16 and torch.equal(y, x)


def test_deserialize_rejects_malformed_tensors():
    good = serialize_tensor(torch.zeros(2, 3))
    with pytest.raises(ProtocolError, match="does not match shape"):
        deserialize_tensor(runtime_pb2.Tensor(buffer=good.buffer[:-4], size=[2, 3], dtype="float32"))
    with pytest.raises(ProtocolError, match="unsupported tensor dtype"):
        deserialize_tensor(runtime_pb2.Tensor(buffer=b"\0" * 8, size=[1], dtype="object"))
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        deserialize_tensor(good, max_elements=5)


def test_streaming_split_and_combine_restore_every_tensor():
    tensors = [torch.randn(300, 200), torch.arange(7), torch.empty(0)]
    parts = [part for t in tensors for part in split_for_streaming(serialize_tensor(t), chunk_bytes=4096)]
    assert len(parts) > 60  # the big one really was cut
    restored = [deserialize_tensor(m) for m in combine_parts(parts)]
    assert all(torch.equal(a, b) for a, b in zip(tensors, restored)) and len(restored) == 3
    with pytest.raises(ProtocolError, match="without a header"):
        combine_parts([runtime_pb2.Tensor(buffer=b"xx")])


def test_stream_messages_put_metadata_on_the_first_message_only():
    serialized = [serialize_tensor(torch.randn(100, 1000))]
    messages = list(stream_messages(serialized, runtime_pb2.ExpertRequest, b"meta"))
    assert len(messages) > 1 and messages[0].metadata == b"meta" and all(not m.metadata for m in messages[1:])
    assert list(stream_messages([], runtime_pb2.ExpertRequest, b"m"))[0].metadata == b"m"


def test_chain_uids():
    assert chain_uid("llama", 3, 6) == "llama.3 llama.4 llama.5"
    assert parse_chain_uid("Llama-2-7b-hf.0 Llama-2-7b-hf.1", "Llama-2-7b-hf") == [0, 1]
    for bad in ("other.0", "llama.x", "", "llama.1  llama.2", "llama"):
        with pytest.raises(ProtocolError):
            parse_chain_uid(bad, "llama")


def test_block_schemas_survive_msgpack_and_name_the_dtypes():
    schemas = block_schemas(64, torch.bfloat16)
    wire = MSGPackSerializer.loads(MSGPackSerializer.dumps(schemas))
    assert isinstance(wire["forward_schema"][0][0], BatchTensorDescriptor)
    # Petals 2.2 clients send (hidden_states, prompts) to rpc_forward and insist that this is one tensor MORE than
    # the forward schema lists: a schema naming the prompts makes them refuse the server
    assert len(wire["forward_schema"][0]) == 1 and len(wire["inference_schema"][0]) == 3
    assert schema_dtypes(wire["inference_schema"]) == [torch.bfloat16, torch.bfloat16, torch.int64]
    assert wire["forward_schema"][1] == {} and wire["inference_schema"][1] == {}
    assert wire["outputs_schema"][0].shape[-1] == 64


def test_empty_tensors_round_trip():
    empty = deserialize_tensor(serialize_tensor(torch.empty(0, dtype=torch.int64)))
    assert empty.numel() == 0 and empty.dtype == torch.int64 and tuple(empty.shape) == (0,)


def test_stream_messages_go_out_in_one_write_and_read_back():
    import asyncio

    from hivemind.p2p import P2P
    from hivemind.proto.p2pd_pb2 import RPCError

    import hivekeeper.core.swarm.protocol  # noqa: F401  (installs the one-write sender)

    class Writer:  # records each write, as a transport would send it
        def __init__(self):
            self.writes: list[bytes] = []

        def write(self, data) -> None:
            self.writes.append(bytes(data))

        async def drain(self) -> None:
            pass

    message = runtime_pb2.ExpertRequest(uid="m.0", metadata=b"\x80",
                                        tensors=[runtime_pb2.Tensor(buffer=b"\x01" * 300, size=[75], dtype="float32")])

    async def roundtrip():
        writer = Writer()
        await P2P.send_protobuf(message, writer)
        await P2P.send_protobuf(RPCError(message="boom"), writer)
        reader = asyncio.StreamReader()
        reader.feed_data(b"".join(writer.writes))
        reader.feed_eof()
        got, _ = await P2P.receive_protobuf(runtime_pb2.ExpertRequest, reader)
        _, error = await P2P.receive_protobuf(runtime_pb2.ExpertRequest, reader)
        return writer.writes, got, error

    writes, got, error = asyncio.run(roundtrip())
    body = message.SerializeToString()
    assert writes[0] == b"\x00" + len(body).to_bytes(8, "big") + body  # hivemind's framing, in one write
    assert len(writes) == 2 and writes[1][:1] == b"\x01"
    assert got == message and error.message == "boom"


def test_a_push_carries_a_whole_step_with_its_structure():
    """Petals servers unpack pushed steps with the session's args_structure: hidden_states, prompts, hypo_ids."""
    output = torch.randn(1, 1, 64)
    request = push_request(output, "demo.2:4", "session-1", "step-7", (("peer", "s2", 4, 6),))
    metadata = unpack_metadata(request.metadata)
    assert metadata["session_id"] == "session-1" and metadata["step_id"] == "step-7"
    assert [tuple(hop) for hop in metadata["next_servers"]] == [("peer", "s2", 4, 6)]
    args, kwargs = unpack_args([deserialize_tensor(t) for t in request.tensors], metadata["args_structure"])
    assert len(args) == 3 and kwargs == {}
    hidden, prompts, hypo_ids = args
    assert torch.equal(hidden, output) and prompts.numel() == 0 and hypo_ids.dtype == torch.int64
