"""The Petals wire format on hivemind: handler names, packed arguments, metadata, tensors and schemas.

Everything a node and a client must agree on byte for byte lives here, so that the server and the client (and a
Petals peer on the other end) read the same messages. See docs/swarm.md for the protocol in prose.

- Requests and responses are hivemind `runtime_pb2` messages (ExpertRequest / ExpertResponse / ExpertUID /
  ExpertInfo). Their `metadata` is `MSGPackSerializer` bytes (tuples survive as msgpack ext 0x40).
- Tensors travel flat; `args_structure` in the metadata is the nesting `(args, kwargs)` with every tensor
  replaced by a bytes marker `b"__T<index>"`.
- Tensors are hivemind-serialized; bfloat16 may come as raw 16-bit data or (legacy) as float32 values.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, AsyncIterator, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
import uvloop
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError
from hivemind.utils import MSGPackSerializer
from hivemind.utils.nested import nested_flatten, nested_pack
from hivemind.utils.tensor_descr import BatchTensorDescriptor

HANDLER_CLASS = "TransformerConnectionHandler"  # the class name Petals clients call
PROTOCOL_VERSION = "2.3.0.dev2"  # the Petals release whose wire format this module speaks
MAX_UNARY_BYTES = 4 * 1024 * 1024  # p2pd's cap on one unary message
STREAM_SWITCH_BYTES = 1024 * 1024  # above this, use the *_stream variants (as Petals does)
STREAM_CHUNK_BYTES = 256 * 1024  # tensor chunk size inside a stream
# a unary response must leave room for p2pd's own envelope (call id, field tags) inside MAX_UNARY_BYTES
UNARY_ENVELOPE_BYTES = 4096
MAX_METADATA_BYTES = 64 * 1024  # msgpack metadata of one message: checked before unpacking (Petals' is < 1 KiB)
# one message of a stream, checked from its 8-byte length header before its body is read: a whole inference step
# up to the servers' default request limit (64 MiB) plus its metadata
MAX_STREAM_MESSAGE_BYTES = 64 * 1024 * 1024 + MAX_METADATA_BYTES
MAX_UID_CHARS = 16384  # a chain uid: all 126 blocks of a 31-character prefix take ~4600; longer is refused unsplit
MAX_BLOCK_INDEX_DIGITS = 6
LOG_CLIP_CHARS = 80  # peer-controlled text (uids, ids) quoted in errors and logs is cut to this
BUSY_MESSAGE = "server busy:"  # every refusal for load (not for a malformed request) starts with this

_MARKER = re.compile(rb"^__T(\d+)$")
_INDEX = re.compile(f"[0-9]{{1,{MAX_BLOCK_INDEX_DIGITS}}}", re.ASCII)
# dtype name on the wire -> bytes per element as sent (bfloat16 may also come as float32: handled apart)
_WIRE_DTYPES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
_NUMPY_DTYPES = {name: np.dtype(name) for name in _WIRE_DTYPES if name != "bfloat16"}


class ProtocolError(ValueError):
    """A malformed request or response: the peer gets (or sent) an error, the node keeps serving."""


class ServerBusy(ProtocolError):
    """A well-formed request refused for load (sessions, bytes, concurrent requests, a per-peer quota). Its text
    starts with BUSY_MESSAGE; a client that sees it (`is_busy`) tries another server at once, without counting the
    server as failed or waiting for it."""

    def __init__(self, reason: str):
        super().__init__(f"{BUSY_MESSAGE} {reason}")


def is_busy(error: BaseException | str) -> bool:
    """Whether an error (ours, or the P2PHandlerError text a client gets for it) is a server's busy answer."""
    return BUSY_MESSAGE in str(error)


def clip(value: Any, limit: int = LOG_CLIP_CHARS) -> str:
    """repr(value), cut to `limit` characters with the full length noted: peer-controlled text in errors and logs."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def handler_name(method: str) -> str:
    """The p2pd protocol name of an RPC, e.g. 'TransformerConnectionHandler.rpc_inference'."""
    return f"{HANDLER_CLASS}.{method}"


# ---- uids ------------------------------------------------------------------------------------------------------
def block_uid(dht_prefix: str, index: int) -> str:
    return f"{dht_prefix}.{index}"


def chain_uid(dht_prefix: str, start: int, end: int) -> str:
    """The uid of a chain of blocks [start, end): block uids joined by single spaces."""
    return " ".join(block_uid(dht_prefix, i) for i in range(start, end))


def parse_chain_uid(chain: str, dht_prefix: str) -> list[int]:
    """Block indices of a chain uid; raises ProtocolError for a foreign prefix or a malformed index."""
    if not isinstance(chain, str) or not chain.strip():
        raise ProtocolError("empty uid: name the blocks as '<dht_prefix>.<index>' joined by spaces")
    if len(chain) > MAX_UID_CHARS:
        raise ProtocolError(f"uid of {len(chain)} characters exceeds the limit of {MAX_UID_CHARS}")
    indices = []
    for uid in chain.split(" "):
        prefix, dot, index = uid.rpartition(".")
        # ASCII digits only: str.isdigit also accepts '١' (int() reads it as 1) and '²' (int() refuses it)
        if not dot or prefix != dht_prefix or not _INDEX.fullmatch(index):
            raise ProtocolError(f"unknown block uid {clip(uid)} (this server serves {dht_prefix}.<index>)")
        indices.append(int(index))
    return indices


# ---- metadata ------------------------------------------------------------------------------------------------------
def pack_metadata(metadata: dict) -> bytes:
    return MSGPackSerializer.dumps(metadata)


def unpack_metadata(raw: bytes, max_bytes: int = MAX_METADATA_BYTES) -> dict:
    """Metadata bytes -> dict ({} for empty bytes); anything else, or more than max_bytes (checked before
    unpacking), is a ProtocolError."""
    if not raw:
        return {}
    if len(raw) > max_bytes:
        raise ProtocolError(f"metadata of {len(raw)} bytes exceeds the limit of {max_bytes}")
    try:
        metadata = MSGPackSerializer.loads(raw)
    except Exception as exc:
        raise ProtocolError(f"metadata is not msgpack: {exc}") from None
    if not isinstance(metadata, dict):
        raise ProtocolError(f"metadata must be a msgpack map, got {type(metadata).__name__}")
    return metadata


# ---- packed arguments ----------------------------------------------------------------------------------------------
def pack_args(*args, **kwargs) -> tuple[list[torch.Tensor], tuple]:
    """Flatten (args, kwargs) into a list of tensors plus a structure where each tensor is b"__T<index>".

    A tensor object passed twice is sent once.
    """
    tensors: list[torch.Tensor] = []
    index_of: dict[int, int] = {}
    masked = []
    for value in nested_flatten((args, kwargs)):
        if isinstance(value, torch.Tensor):
            index = index_of.setdefault(id(value), len(tensors))
            if index == len(tensors):
                tensors.append(value)
            masked.append(b"__T%d" % index)
        else:
            masked.append(value)
    return tensors, nested_pack(masked, (args, kwargs))


def unpack_args(tensors: Sequence[torch.Tensor], structure: Any) -> tuple[tuple, dict]:
    """Inverse of pack_args. With no structure (older peers), the tensors are the positional arguments."""
    if structure is None:
        return tuple(tensors), {}
    if not (isinstance(structure, (tuple, list)) and len(structure) == 2 and isinstance(structure[1], dict)):
        raise ProtocolError("args_structure must be a pair (args, kwargs)")

    def restore(value):
        if isinstance(value, bytes):
            match = _MARKER.match(value)
            if match:
                index = int(match.group(1))
                if index >= len(tensors):
                    raise ProtocolError(f"args_structure names tensor {index}, the request has {len(tensors)}")
                return tensors[index]
        return value

    flat = [restore(value) for value in nested_flatten(structure)]
    args, kwargs = nested_pack(flat, structure)
    return tuple(args), dict(kwargs)


# ---- tensors ---------------------------------------------------------------------------------------------------
def serialize_tensor(tensor: torch.Tensor, compression: int = runtime_pb2.CompressionType.NONE) -> runtime_pb2.Tensor:
    """hivemind's wire form of a tensor. Uncompressed non-bf16 tensors take a direct path that writes the same
    message as hivemind's serializer, without its per-call descriptor work (it matters on 1-token steps)."""
    if compression in _EIGHT_BIT:
        return _encode_8bit(tensor, compression)
    if compression != runtime_pb2.CompressionType.NONE or tensor.dtype == torch.bfloat16:
        return serialize_torch_tensor(tensor.cpu(), compression)  # bf16 as hivemind sends it (legacy fp32 default)
    return runtime_pb2.Tensor(compression=compression, buffer=tensor.detach().cpu().numpy().tobytes(),
                              size=tensor.shape, dtype=dtype_name(tensor.dtype), requires_grad=tensor.requires_grad)


def deserialize_tensor(message: runtime_pb2.Tensor, max_elements: int | None = None) -> torch.Tensor:
    """A wire tensor -> torch.Tensor, after checking its dtype and that its buffer matches its shape.

    Accepts bfloat16 both as raw 16-bit data and in hivemind's legacy float32 form.
    """
    numel = 1
    for dim in message.size:
        numel *= dim
    if max_elements is not None and numel > max_elements:
        raise ProtocolError(f"tensor of {numel} elements exceeds the limit of {max_elements}")
    if message.compression == runtime_pb2.CompressionType.NONE:
        itemsize = _WIRE_DTYPES.get(message.dtype)
        if itemsize is None:
            raise ProtocolError(f"unsupported tensor dtype {message.dtype!r}")
        if numel == 0 and not message.buffer:  # unused prompts / hypo_ids on every step: skip numpy
            return torch.empty(tuple(message.size), dtype=getattr(torch, message.dtype))
        sizes = {numel * itemsize} | ({numel * 4} if message.dtype == "bfloat16" else set())
        if len(message.buffer) not in sizes:
            raise ProtocolError(
                f"tensor buffer of {len(message.buffer)} bytes does not match shape {list(message.size)} "
                f"of {message.dtype}"
            )
        if message.dtype != "bfloat16" and len(message.buffer) == numel * itemsize:
            # hivemind's own path, without its per-call torch.Size / dtype lookups (they add up on 1-token steps)
            array = np.frombuffer(message.buffer, dtype=_NUMPY_DTYPES[message.dtype]).copy()  # bytes are read-only
            tensor = torch.from_numpy(array).view(tuple(message.size))
            return tensor.requires_grad_(True) if message.requires_grad else tensor
    if message.compression in _EIGHT_BIT:
        return _decode_8bit(message, numel)
    try:
        return deserialize_torch_tensor(message)
    except Exception as exc:
        raise ProtocolError(f"cannot decode tensor: {exc}") from None


# ---- 8-bit wire compression ---------------------------------------------------------------------------------------
# hivemind's layouts (a Petals peer reads and writes these), coded here because hivemind's own decoder fails under
# numpy 2 (int() of a 1-element array) and its BLOCKWISE_8BIT codec imports bitsandbytes (seconds, on the event
# loop) for what is a table lookup:
#   UNIFORM_8BIT / QUANTILE_8BIT: int64 n, float32 codebook[n], uint8 index per element;
#   BLOCKWISE_8BIT: int64 n_blocks, int64 n, float32 absmax[n_blocks], float32 code[n], uint8 index per element;
#   value = code[index] * absmax[element // BLOCKWISE_BLOCK].
_EIGHT_BIT = {runtime_pb2.CompressionType.UNIFORM_8BIT, runtime_pb2.CompressionType.QUANTILE_8BIT,
              runtime_pb2.CompressionType.BLOCKWISE_8BIT}
BLOCKWISE_BLOCK = 4096
_BINS = 256
_UNIFORM_RANGE_SIGMAS = 6  # UNIFORM_8BIT spreads its bins over mean ± 3 sigma, as hivemind does


def _encode_8bit(tensor: torch.Tensor, compression: int) -> runtime_pb2.Tensor:
    if not tensor.is_floating_point():
        raise ProtocolError(f"8-bit compression needs a float tensor, got {tensor.dtype}")
    values = tensor.detach().cpu().float().reshape(-1)
    if compression == runtime_pb2.CompressionType.BLOCKWISE_8BIT:
        body = _blockwise_body(values)
    else:
        indices = _uniform_indices(values) if compression == runtime_pb2.CompressionType.UNIFORM_8BIT \
            else _quantile_indices(values)
        codebook = torch.zeros(_BINS).scatter_add_(0, indices, values)
        codebook /= torch.bincount(indices, minlength=_BINS).clamp_min(1)  # each bin's mean
        body = b"".join((np.int64(_BINS).tobytes(), codebook.numpy().tobytes(),
                         indices.to(torch.uint8).numpy().tobytes()))
    return runtime_pb2.Tensor(compression=compression, buffer=body, size=tensor.shape,
                              dtype=dtype_name(tensor.dtype), requires_grad=tensor.requires_grad)


def _uniform_indices(values: torch.Tensor) -> torch.Tensor:
    centered = values - values.mean() if values.numel() else values
    scale = _UNIFORM_RANGE_SIGMAS * centered.std().item() / _BINS if values.numel() > 1 else 0.0
    scale = scale if np.isfinite(scale) and scale > 0 else 1.0
    return (torch.round(centered / scale) + _BINS // 2).clamp_(0, _BINS - 1).long()


def _quantile_indices(values: torch.Tensor) -> torch.Tensor:
    if not values.numel():
        return values.long()
    borders = np.quantile(values.numpy(), np.linspace(0.0, 1.0, _BINS + 1)[1:-1]).astype(np.float32)
    return torch.from_numpy(np.searchsorted(borders, values.numpy())).clamp_(0, _BINS - 1).long()


def _blockwise_body(values: torch.Tensor) -> bytes:
    n_blocks = -(-values.numel() // BLOCKWISE_BLOCK)
    padded = torch.zeros(n_blocks * BLOCKWISE_BLOCK)
    padded[: values.numel()] = values
    blocks = padded.view(n_blocks, BLOCKWISE_BLOCK)
    absmax = blocks.abs().amax(dim=1) if n_blocks else torch.zeros(0)
    code = torch.linspace(-1.0, 1.0, _BINS)  # any code works: it travels with the data
    scaled = blocks / torch.where(absmax > 0, absmax, torch.ones(())).unsqueeze(1)
    indices = torch.round((scaled + 1.0) * (_BINS - 1) / 2).clamp_(0, _BINS - 1).to(torch.uint8)
    return b"".join((np.int64(n_blocks).tobytes(), np.int64(_BINS).tobytes(), absmax.numpy().tobytes(),
                     code.numpy().tobytes(), indices.reshape(-1)[: values.numel()].numpy().tobytes()))


def _decode_8bit(message: runtime_pb2.Tensor, numel: int) -> torch.Tensor:
    """An 8-bit tensor, every count and index checked against the buffer before any lookup."""
    dtype = DTYPES.get(message.dtype)
    if dtype is None:
        raise ProtocolError(f"8-bit compressed tensors must be float32/float16/bfloat16, got {clip(message.dtype)}")
    buffer = message.buffer
    blockwise = message.compression == runtime_pb2.CompressionType.BLOCKWISE_8BIT
    counts = _header_counts(buffer, 2 if blockwise else 1)
    n_blocks, code_size = (counts if blockwise else (0, counts[0]))
    if blockwise and n_blocks != -(-numel // BLOCKWISE_BLOCK):
        raise ProtocolError(f"8-bit tensor of {numel} elements needs {-(-numel // BLOCKWISE_BLOCK)} blocks, "
                            f"the buffer says {n_blocks}")
    if not 1 <= code_size <= _BINS:
        raise ProtocolError(f"8-bit codebook of {code_size} entries (1 to {_BINS} allowed)")
    offset = 8 * len(counts)
    if len(buffer) != offset + 4 * (n_blocks + code_size) + numel:
        raise ProtocolError(f"8-bit tensor buffer of {len(buffer)} bytes does not match shape {list(message.size)}")
    absmax = torch.from_numpy(np.frombuffer(buffer, np.float32, n_blocks, offset).copy())
    code = torch.from_numpy(np.frombuffer(buffer, np.float32, code_size, offset + 4 * n_blocks).copy())
    indices = torch.from_numpy(np.frombuffer(buffer, np.uint8, numel, offset + 4 * (n_blocks + code_size)).copy())
    if numel and int(indices.max()) >= code_size:
        raise ProtocolError(f"8-bit index {int(indices.max())} is outside the codebook of {code_size}")
    values = code[indices.long()]
    if blockwise:
        values = values * absmax.repeat_interleave(BLOCKWISE_BLOCK)[:numel]
    tensor = values.to(dtype).reshape(tuple(message.size))
    return tensor.requires_grad_(True) if message.requires_grad else tensor


def _header_counts(buffer: bytes, count: int) -> tuple[int, ...]:
    if len(buffer) < 8 * count:
        raise ProtocolError(f"8-bit tensor buffer of {len(buffer)} bytes is shorter than its header")
    return tuple(int(n) for n in np.frombuffer(buffer, np.int64, count).tolist())


def unary_response_size_ok(message, method: str) -> None:
    """Refuse (ProtocolError) a unary response that would not fit p2pd's unary cap: hivemind cannot send it, and its
    handler task (with the response) is never released, so it would neither arrive nor be freed."""
    _unary_fits(message.ByteSize(), method)


def unary_output_fits(numel: int, dtype: torch.dtype, compression: int, method: str) -> None:
    """The same refusal before computing, from an output's size: bytes per element as `serialize_tensor` sends them
    (bfloat16 goes as float32 uncompressed; 16-bit compressions 2 bytes, 8-bit ones 1)."""
    per_element = {runtime_pb2.CompressionType.FLOAT16: 2, runtime_pb2.CompressionType.MEANSTD_16BIT: 2}.get(
        compression, 1 if compression in _EIGHT_BIT else (4 if dtype == torch.bfloat16 else dtype.itemsize))
    _unary_fits(numel * per_element, method)


def _unary_fits(size: int, method: str) -> None:
    if size + UNARY_ENVELOPE_BYTES > MAX_UNARY_BYTES:
        raise ProtocolError(f"response of {size} bytes exceeds the unary limit of {MAX_UNARY_BYTES} bytes; call "
                            f"{method}_stream for it (as Petals clients do above {STREAM_SWITCH_BYTES} bytes)")


def split_for_streaming(message: runtime_pb2.Tensor, chunk_bytes: int = STREAM_CHUNK_BYTES) -> Iterator[runtime_pb2.Tensor]:
    """Cut a serialized tensor into parts: the first carries the header and `chunks`, the rest only bytes."""
    buffer = memoryview(message.buffer)
    num_chunks = max(1, -(-len(buffer) // chunk_bytes))
    yield runtime_pb2.Tensor(
        compression=message.compression,
        buffer=buffer[:chunk_bytes].tobytes(),
        chunks=num_chunks,
        size=message.size,
        dtype=message.dtype,
        requires_grad=message.requires_grad,
    )
    for offset in range(chunk_bytes, len(buffer), chunk_bytes):
        yield runtime_pb2.Tensor(buffer=buffer[offset : offset + chunk_bytes].tobytes())


def combine_parts(parts: Iterable[runtime_pb2.Tensor]) -> list[runtime_pb2.Tensor]:
    """Reassemble streamed tensor parts: a part with a dtype starts a new tensor, others extend the last one."""
    tensors: list[runtime_pb2.Tensor] = []
    buffers: list[list[bytes]] = []
    for part in parts:
        if part.dtype:
            header = runtime_pb2.Tensor()
            header.CopyFrom(part)
            tensors.append(header)
            buffers.append([part.buffer])
        elif tensors:
            buffers[-1].append(part.buffer)
        else:
            raise ProtocolError("streamed tensor part without a header")
    for tensor, pieces in zip(tensors, buffers):
        tensor.buffer = b"".join(pieces)
    return tensors


async def read_stream(requests: AsyncIterator, max_bytes: int,
                      on_bytes: Callable[[int], None] = lambda nbytes: None
                      ) -> tuple[str, list[runtime_pb2.Tensor], dict]:
    """Collect a *_stream request: (uid, whole tensors, metadata of the first message), within max_bytes.
    on_bytes(n) is told of each part before it is kept (it may raise to refuse it)."""
    uid, metadata, parts, total = None, None, [], 0
    async for request in requests:
        if uid is None:
            uid, metadata = request.uid, unpack_metadata(request.metadata)
        for part in request.tensors:
            total += len(part.buffer)
            if total > max_bytes:
                raise ProtocolError(f"request exceeds the limit of {max_bytes} bytes")
            on_bytes(len(part.buffer))
            parts.append(part)
    if uid is None:
        raise ProtocolError("empty request stream")
    return uid, combine_parts(parts), metadata


def stream_messages(tensors: Sequence[runtime_pb2.Tensor], make_message, metadata: bytes = b"") -> Iterator:
    """Yield messages (made by make_message(tensors=..., metadata=...)) carrying the tensors in chunks."""
    first = True
    for tensor in tensors:
        for part in split_for_streaming(tensor):
            yield make_message(tensors=[part], metadata=metadata if first else b"")
            first = False
    if first:  # no tensors at all: still send the metadata
        yield make_message(tensors=[], metadata=metadata)


# ---- schemas (rpc_info) --------------------------------------------------------------------------------------------
def push_request(output: torch.Tensor, uid: str, session_id: str, step_id: str | None,
                 next_servers: tuple) -> runtime_pb2.ExpertRequest:
    """rpc_push of a step's output to the next server: a whole step, as the client would send it. Petals servers
    unpack every step, pushed or not, with the session's args_structure (hidden_states, prompts, hypo_ids), so a
    lone hidden_states tensor fails there."""
    no_prompts, keep_order = torch.empty(0, dtype=output.dtype), torch.empty(0, dtype=torch.int64)
    tensors, structure = pack_args(output, no_prompts, keep_order)
    return runtime_pb2.ExpertRequest(
        uid=uid, tensors=[serialize_tensor(t) for t in tensors],
        metadata=pack_metadata({"session_id": session_id, "step_id": step_id, "next_servers": next_servers,
                                "args_structure": structure}))


def block_schemas(hidden_size: int, dtype: torch.dtype) -> dict:
    """The schemas a block advertises in rpc_info: clients read input dtypes and compression from them.

    forward: (hidden_states,); inference: (hidden_states, prompts, hypo_ids); both with empty kwargs. A forward
    request still carries the prompts after hidden_states: Petals clients (2.2) assert that they send one tensor more
    than the forward schema's args, so a schema that lists the prompts makes them refuse the server.
    """
    hidden = BatchTensorDescriptor(None, hidden_size, dtype=dtype)  # [batch, tokens, hidden]
    prompts = BatchTensorDescriptor((), dtype=dtype)  # deep prompts, or an empty tensor
    hypo_ids = BatchTensorDescriptor((), dtype=torch.int64)
    return {
        "forward_schema": ((hidden,), {}),
        "outputs_schema": (hidden,),
        "inference_schema": ((hidden, prompts, hypo_ids), {}),
        "keyword_names": (),
    }


def schema_dtypes(schema: Any) -> list[torch.dtype | None]:
    """The dtype of each tensor a schema describes, in wire order (None where a peer left it open)."""
    return [getattr(descriptor, "dtype", None) for descriptor in nested_flatten(schema)]


# ---- dtypes ------------------------------------------------------------------------------------------------------
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ---- stream framing ------------------------------------------------------------------------------------------------
async def _send_protobuf_coalesced(protobuf, writer) -> None:
    """hivemind's P2P.send_protobuf, writing the same bytes (marker, 8-byte length, body) in ONE write. hivemind
    writes them in three: each becomes its own send to p2pd and its own frame between the daemons, with a wake-up
    at each end. On a 1-token step this took bench/swarm_hop.py from ~4.5 to ~3.7 ms of overhead per hop."""
    body = protobuf.SerializeToString()
    marker = P2P.ERROR_MARKER if isinstance(protobuf, RPCError) else P2P.MESSAGE_MARKER
    writer.write(b"".join((marker, len(body).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER), body)))
    await writer.drain()


async def _receive_raw_data_capped(reader: asyncio.StreamReader) -> bytes:
    """hivemind's P2P.receive_raw_data, refusing a message by its 8-byte length header before reading its body:
    hivemind reads the whole body first, so a 300 MiB message took 300 MiB before any limit could see it. The
    stream then ends (hivemind logs the refusal and closes it)."""
    length = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
    if length > MAX_STREAM_MESSAGE_BYTES:
        raise ProtocolError(f"stream message of {length} bytes exceeds the limit of {MAX_STREAM_MESSAGE_BYTES}")
    return await reader.readexactly(length)


# process-wide on import (every stream of ours, DHT or not; unary calls do not use them): the bytes on the wire do
# not change, only how many writes carry them, and how big a message may be announced before it is read
P2P.send_protobuf = staticmethod(_send_protobuf_coalesced)
P2P.receive_raw_data = staticmethod(_receive_raw_data_capped)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """The swarm's event loop: uvloop's (hivemind already depends on it). Every message of an inference step wakes
    several tasks on both ends, and uvloop's loop iterations cost less than asyncio's."""
    return uvloop.new_event_loop()
