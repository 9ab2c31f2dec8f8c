"""Issue 17's wire-level items without a network: the 8-bit compression types both ways under numpy 2 (hivemind's
own decoder fails there), hostile 8-bit buffers, no bitsandbytes import for BLOCKWISE_8BIT, the metadata cap, ASCII
block indices, clipped uids, and the compute thread's priorities."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.proto import runtime_pb2

from hivekeeper.core.swarm.protocol import (
    BLOCKWISE_BLOCK,
    MAX_METADATA_BYTES,
    ProtocolError,
    ServerBusy,
    clip,
    deserialize_tensor,
    is_busy,
    pack_metadata,
    parse_chain_uid,
    serialize_tensor,
    unpack_metadata,
)
from hivekeeper.core.swarm.server.compute import FORWARD, INFERENCE, PriorityWorker

C = runtime_pb2.CompressionType
EIGHT_BIT = [C.UNIFORM_8BIT, C.QUANTILE_8BIT, C.BLOCKWISE_8BIT]


@pytest.mark.parametrize("compression", EIGHT_BIT)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_8bit_types_round_trip_in_every_float_dtype(compression, dtype):
    torch.manual_seed(0)
    tensor = torch.randn(3, BLOCKWISE_BLOCK + 5).to(dtype)  # two blocks, the second short
    message = serialize_tensor(tensor, compression)
    assert message.compression == compression and len(message.buffer) < tensor.numel() + 9000  # ~1 byte each
    back = deserialize_tensor(message)
    assert back.dtype == dtype and back.shape == tensor.shape
    error = (back.float() - tensor.float()).abs()
    # per element: blockwise within absmax/127 (+ the dtype's rounding); the codebook types on average
    bound = {C.BLOCKWISE_8BIT: error.max(), C.UNIFORM_8BIT: error.mean(), C.QUANTILE_8BIT: error.mean()}[compression]
    assert bound < 0.05, (compression, dtype, bound)
    for empty in (torch.zeros(0, 64, dtype=dtype), torch.full((1,), 2.5, dtype=dtype)):
        assert torch.equal(deserialize_tensor(serialize_tensor(empty, compression)), empty)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")  # inside hivemind's encoder
@pytest.mark.parametrize("compression", [C.UNIFORM_8BIT, C.QUANTILE_8BIT])
def test_hivemind_8bit_tensors_decode(compression):
    """What a Petals peer sends (hivemind's encoder) decodes here; hivemind's own decoder raises under numpy 2."""
    torch.manual_seed(1)
    tensor = torch.randn(4, 300)
    back = deserialize_tensor(serialize_torch_tensor(tensor, compression))
    assert (back - tensor).abs().mean() < 0.05


def hostile(compression, counts, body: bytes, size=(4,)) -> runtime_pb2.Tensor:
    header = np.array(counts, dtype=np.int64).tobytes()
    return runtime_pb2.Tensor(compression=compression, buffer=header + body, size=size, dtype="float32")


def test_hostile_8bit_buffers_are_refused_before_any_lookup():
    code = np.linspace(-1, 1, 4, dtype=np.float32).tobytes()
    cases = [
        (hostile(C.UNIFORM_8BIT, [2**40], b""), "codebook of 1099511627776 entries"),
        (hostile(C.UNIFORM_8BIT, [-1], b""), "codebook of -1 entries"),
        (hostile(C.UNIFORM_8BIT, [4], code + bytes([0, 1, 2])), "does not match shape"),
        (hostile(C.UNIFORM_8BIT, [4], code + bytes([0, 1, 2, 200])), "index 200 is outside the codebook of 4"),
        (runtime_pb2.Tensor(compression=C.QUANTILE_8BIT, buffer=b"\1\2", size=[1], dtype="float32"),
         "shorter than its header"),
        (hostile(C.BLOCKWISE_8BIT, [5, 4], b""), "needs 1 blocks, the buffer says 5"),
        (runtime_pb2.Tensor(compression=C.BLOCKWISE_8BIT, buffer=b"\0" * 16, size=[1], dtype="int64"),
         "must be float32/float16/bfloat16"),
    ]
    for message, error in cases:
        with pytest.raises(ProtocolError, match=error):
            deserialize_tensor(message)


def test_blockwise_8bit_needs_no_bitsandbytes(monkeypatch):
    """The first BLOCKWISE_8BIT request stalled a server for seconds importing bitsandbytes: with that import made
    to fail, both ways still work."""
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` now raises ImportError
    monkeypatch.setitem(sys.modules, "bitsandbytes.functional", None)
    tensor = torch.randn(2, 5000)
    back = deserialize_tensor(serialize_tensor(tensor, C.BLOCKWISE_8BIT))
    assert (back - tensor).abs().max() < 0.05


def test_metadata_is_capped_before_unpacking():
    assert unpack_metadata(pack_metadata({"a": "x" * 1000})) == {"a": "x" * 1000}
    with pytest.raises(ProtocolError, match=f"metadata of {MAX_METADATA_BYTES + 1} bytes exceeds the limit"):
        unpack_metadata(b"\x00" * (MAX_METADATA_BYTES + 1))


def test_block_indices_are_ascii_digits_and_uids_are_clipped_in_errors():
    assert parse_chain_uid("m.0 m.1 m.123456", "m") == [0, 1, 123456]
    for uid in ("m.\u0661", "m.\u00b2", "m.1\u0663", "m.1234567", "m.+1", "m. 1", "m.-1", "m.1_0"):
        with pytest.raises(ProtocolError, match="unknown block uid"):
            parse_chain_uid(uid, "m")
    with pytest.raises(ProtocolError) as refused:
        parse_chain_uid("m." + "x" * 10_000, "m")
    assert len(str(refused.value)) < 200 and "(10004 chars)" in str(refused.value)
    assert clip("abc") == "'abc'"


def test_busy_answers_are_recognised_by_their_text():
    busy = ServerBusy("16 sessions open (limit 16)")
    assert isinstance(busy, ProtocolError) and is_busy(busy) and is_busy(f"P2PHandlerError: {busy!r}")
    assert not is_busy(ProtocolError("hidden_states must be a float tensor"))


def test_the_compute_thread_runs_inference_before_queued_forwards():
    worker = PriorityWorker()
    release, order = threading.Event(), []
    try:
        worker.submit(FORWARD, release.wait, 10)  # busy: the rest queue up
        forwards = [worker.submit(FORWARD, order.append, f"forward {i}") for i in range(3)]
        step = worker.submit(INFERENCE, order.append, "inference step")
        release.set()
        for future in (*forwards, step):
            future.result(10)
        assert order == ["inference step", "forward 0", "forward 1", "forward 2"]
        failing = worker.submit(INFERENCE, int, "not a number")
        with pytest.raises(ValueError):
            failing.result(10)
    finally:
        worker.close()
    assert worker.submit(INFERENCE, order.append, "late").cancelled()
