"""The server's RPC handlers, registered as `TransformerConnectionHandler.*` so Petals clients can call them.

rpc_info, rpc_inference (one streaming session with a KV cache held here), rpc_forward / rpc_backward (unary and
`_stream`), rpc_push (a peer server hands us its step output). Every malformed request gets an error response (the
exception text) and the server keeps serving everyone else. Compute runs on one worker thread, so the event loop
keeps answering the DHT and other peers meanwhile; inference steps go before forward/backward there (`compute`).
Load is bounded per peer and in all (`quotas`, ServingLimits): a request over a quota gets a "server busy:" answer
at once, which clients take as "try another server". docs/swarm.md "Limits" lists every limit and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import torch
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

from hivekeeper.core.runtime.model import KVCache, Span, add_prompt
from hivekeeper.core.swarm.server.compute import FORWARD, INFERENCE, PriorityWorker
from hivekeeper.core.swarm.server.memory import AllocationFailed, MemoryPool
from hivekeeper.core.swarm.server.quotas import QuotaLimits, Quotas
from hivekeeper.core.swarm.protocol import (
    HANDLER_CLASS,
    PROTOCOL_VERSION,
    ProtocolError,
    ServerBusy,
    block_schemas,
    chain_uid,
    clip,
    deserialize_tensor,
    handler_name,
    pack_metadata,
    parse_chain_uid,
    push_request,
    read_stream,
    serialize_tensor,
    stream_messages,
    unpack_args,
    unary_output_fits,
    unary_response_size_ok,
    unpack_metadata,
)
from hivekeeper.planner.errors import InputError

logger = logging.getLogger("hivekeeper.swarm.server")

# 1-token steps estimated (from the time per row of an earlier step of the session) to take less than this run on
# the event loop instead of the compute thread: for small models the thread hop costs ~0.5 ms per step, and
# blocking the loop this briefly delays nothing
INLINE_STEP_SECONDS = 0.005
MAX_ID_CHARS = 256  # session_id / step_id / upstream_peer: a uuid is 36, a peer id ~52
# a forward runs as compute tasks of one block and at most this many rows (batch × tokens, whole sequences): 20
# peers' 16384-row forwards delayed a session's first token by the whole forward each; now by one such task
FORWARD_TASK_ROWS = 2048


@dataclass
class ServingLimits:
    """Limits against abuse; a request beyond one gets an error naming the limit."""

    max_length: int = 2048  # tokens per inference session (the cache a session may reserve)
    max_sessions: int = 16  # concurrent inference sessions
    max_request_bytes: int = 64 * 2**20  # tensors in one request (streams included)
    max_forward_tokens: int = 16384  # batch × tokens in one forward/backward
    step_timeout: float = 300.0  # seconds a session may wait for its next step
    session_timeout: float = 1800.0  # seconds a session may last
    max_alloc_timeout: float = 600.0  # cap on the alloc_timeout a client asks for
    default_alloc_timeout: float = 1.0  # when the client names none
    max_sessions_per_peer: int = 4  # inference sessions one peer may hold
    max_requests_per_peer: int = 2  # forward/backward requests one peer may have in flight
    max_peer_bytes: int = 128 * 2**20  # request bytes of one peer's forward/backward requests in flight
    max_inflight_bytes: int = 256 * 2**20  # request bytes of all forward/backward requests in flight
    max_unread_steps: int = 8  # steps (the client's and pushed ones) waiting in a session's inbox
    max_next_servers: int = 32  # servers named in a step's next_servers (its push chain)

    def quotas(self) -> QuotaLimits:
        return QuotaLimits(self.max_sessions_per_peer, self.max_requests_per_peer, self.max_peer_bytes,
                           self.max_inflight_bytes)


@dataclass
class ServedSpan:
    """What the handler serves now: blocks [start, end) of a model under dht_prefix."""

    span: Span
    dht_prefix: str
    device: torch.device
    _subspans: dict = field(default_factory=dict)

    @property
    def start(self) -> int:
        return self.span.start

    @property
    def end(self) -> int:
        return self.span.end

    @property
    def config(self):
        return self.span.config

    @property
    def dtype(self) -> torch.dtype:
        return self.span.dtype

    def sub(self, start: int, end: int) -> Span:
        """A Span over blocks [start, end) of ours (the same modules, no copy)."""
        if (start, end) == (self.start, self.end):
            return self.span
        if (start, end) not in self._subspans:
            blocks = list(self.span.blocks[start - self.start : end - self.start])
            self._subspans[(start, end)] = Span(self.config, start, end, blocks)
        return self._subspans[(start, end)]


@dataclass
class _Session:
    session_id: str
    inbox: asyncio.Queue  # client requests and pushed steps, in arrival order (bounded); None = the client closed
    upstream: str | None = None  # the peer whose pushes are accepted: named by the client, else the first pusher
    upstream_named: bool = False
    steps_done: set = field(default_factory=set)
    steps_order: deque = field(default_factory=deque)

    def check_pusher(self, peer: str) -> None:
        """Accept pushes from the session's upstream peer only (the first pusher's, when the client named none)."""
        if self.upstream is None:
            self.upstream = peer
        elif peer != self.upstream:
            whose = "the client named" if self.upstream_named else "that pushed first"
            raise ProtocolError(f"push refused: this session takes pushes only from the upstream peer {whose}")

    def remember(self, step_id) -> None:
        self.steps_done.add(step_id)
        self.steps_order.append(step_id)
        if len(self.steps_order) > 4096:  # bounded: a step is only ever duplicated soon after it ran
            self.steps_done.discard(self.steps_order.popleft())

    def first_time(self, step_id) -> bool:
        """Whether a step is new (one without a step_id always is); a new one is remembered."""
        if step_id is None:
            return True
        if step_id in self.steps_done:
            return False
        self.remember(step_id)
        return True


@dataclass
class _Step:
    hidden: torch.Tensor  # [batch, tokens, hidden]
    prompts: torch.Tensor | None  # [n_blocks, batch, prefix, hidden] or None
    hypo_ids: torch.Tensor | None  # [batch] int64 or None


@dataclass
class _Opening:
    """The checked first request of an inference session: blocks [start, end) of `served` (while the handler's
    span generation stays `generation`), its limits, and its first step."""

    served: ServedSpan
    generation: int
    start: int
    end: int
    max_length: int
    alloc_timeout: float
    session_id: str
    metadata: dict
    step: _Step

    @property
    def batch(self) -> int:
        return self.step.hidden.shape[0]

    @property
    def cache_bytes(self) -> int:
        served = self.served
        return KVCache.nbytes_for(served.config, self.end - self.start, self.batch, self.max_length, served.dtype)


@dataclass
class _LiveSession:
    """An inference session with its cache allocated: what it runs on, until when, and its last step's time."""

    opening: _Opening
    session: _Session
    span: Span
    cache: KVCache
    deadline: float  # time.monotonic() at which the session timeout ends it
    seconds_per_row: float = float("inf")  # of the last step with rows (batch × tokens): unknown until then

    def inline_estimate(self, step: "_Step") -> float:
        """Seconds a step should take, from its own shape: rows × the time per row seen (0 for no rows)."""
        rows = step.hidden.shape[0] * step.hidden.shape[1]
        return 0.0 if rows == 0 else rows * self.seconds_per_row

    def measured(self, step: "_Step", seconds: float) -> None:
        rows = step.hidden.shape[0] * step.hidden.shape[1]
        if rows:  # a step without rows says nothing about the next one's cost
            self.seconds_per_row = seconds / rows


# ---- inference sessions: checks of the opening request and of a step's position; the pump into the inbox -------
def _session_max_length(metadata: dict, limits: ServingLimits) -> int:
    max_length = metadata.get("max_length")
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= 0:
        raise ProtocolError(f"metadata.max_length must be a positive int, got {max_length!r}")
    if max_length > limits.max_length:
        raise ProtocolError(f"max_length {max_length} exceeds this server's limit of {limits.max_length} "
                            "tokens per session")
    return max_length


def _check_id(value, name: str, required: bool = False):
    """A session_id / step_id / upstream_peer: None (unless required) or a short str; ProtocolError otherwise (an
    unhashable one would raise TypeError in the lookups)."""
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_ID_CHARS:
        raise ProtocolError(f"{name} must be a string of 1 to {MAX_ID_CHARS} characters, got {clip(value)}")
    return value


def _check_next_servers(metadata: dict, limits: ServingLimits) -> tuple:
    """A step's next_servers: at most limits.max_next_servers entries of (peer_id, session_id, start, end)."""
    next_servers = metadata.get("next_servers") or ()
    if not isinstance(next_servers, (list, tuple)) or len(next_servers) > limits.max_next_servers:
        raise ProtocolError(f"next_servers must be a list of at most {limits.max_next_servers} servers, got "
                            f"{clip(next_servers)}")
    for entry in next_servers:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 4 and isinstance(entry[0], str)
                and _check_id(entry[1], "a next_servers session_id", required=True)
                and all(isinstance(i, int) and not isinstance(i, bool) for i in entry[2:])):
            raise ProtocolError(f"next_servers entries must be (peer_id, session_id, start, end), got {clip(entry)}")
    return tuple(next_servers)


def _alloc_timeout(metadata: dict, limits: ServingLimits) -> float:
    alloc_timeout = metadata.get("alloc_timeout", limits.default_alloc_timeout)
    if isinstance(alloc_timeout, bool) or not isinstance(alloc_timeout, (int, float)) or alloc_timeout < 0:
        raise ProtocolError(f"metadata.alloc_timeout must be a number >= 0, got {alloc_timeout!r}")
    return min(float(alloc_timeout), limits.max_alloc_timeout)


def _start_position(live: _LiveSession, step: _Step, step_meta: dict) -> int | None:
    """A step's start_from_position (None: where the cache ends), checked against the cache and the session's
    max_length."""
    cache, max_length = live.cache, live.opening.max_length
    start_from = step_meta.get("start_from_position")
    if start_from is not None and (isinstance(start_from, bool) or not isinstance(start_from, int)
                                   or not 0 <= start_from <= cache.length):
        raise ProtocolError(f"start_from_position {start_from!r} is outside the session's "
                            f"{cache.length} tokens")
    position = cache.length if start_from is None else start_from
    if position + step.hidden.shape[1] > max_length:
        raise ProtocolError(f"{position + step.hidden.shape[1]} tokens exceed the session's "
                            f"max_length {max_length}")
    return start_from


async def _pump(requests: AsyncIterator[runtime_pb2.ExpertRequest], inbox: asyncio.Queue) -> None:
    """A session's client requests into its inbox (pushes land there too); None once the client closes. The inbox
    is bounded: while it is full the pump waits, so hivemind (5 messages prefetched) and p2pd stop reading the
    client's stream, and unread steps stop at the inbox's bound instead of piling up here."""
    with contextlib.suppress(Exception):  # a broken stream ends the session like a closed one
        async for request in requests:
            await inbox.put(request)
    await inbox.put(None)


# ---- compute (runs on the worker thread) ----------------------------------------------------------------------------
def run_blocks(span: Span, hidden: torch.Tensor, cache: KVCache | None, prompts: torch.Tensor | None) -> torch.Tensor:
    """span(hidden, cache), adding deep prompts (one per block) to the first positions of each block's input."""
    hidden = hidden.to(device=span.blocks[0].input_layernorm.weight.device, dtype=span.dtype)
    if prompts is None:
        return span(hidden, cache)
    position = cache.length if cache is not None else 0
    tokens = hidden.shape[1]
    if tokens == 0:
        return hidden
    rope = span.rotary.get(position, tokens, hidden.device, hidden.dtype)
    for i, block in enumerate(span.blocks):
        hidden = add_prompt(hidden, prompts[i])
        k, v = cache.block(i) if cache is not None else (None, None)
        hidden = block(hidden, k, v, position, rope)
    if cache is not None:
        cache.length = position + tokens
    return hidden


def _inference_step(span: Span, cache: KVCache, step: _Step, start_from: int | None) -> torch.Tensor:
    with torch.inference_mode():
        if start_from is not None:
            cache.truncate(start_from)
        if step.hypo_ids is not None:
            cache.reorder(step.hypo_ids)
        return run_blocks(span, step.hidden, cache, step.prompts).cpu()


def _forward(span: Span, step: _Step) -> torch.Tensor:
    """One block's forward (the result stays on the span's device until the last block)."""
    with torch.inference_mode():
        return run_blocks(span, step.hidden, None, step.prompts)


def _backward(span: Span, step: _Step, grad_outputs: torch.Tensor) -> list[torch.Tensor]:
    with torch.enable_grad():
        hidden = step.hidden.detach().to(span.dtype).requires_grad_(True)
        prompts = step.prompts.detach().to(span.dtype).requires_grad_(True) if step.prompts is not None else None
        outputs = run_blocks(span, hidden, None, prompts)
        outputs.backward(grad_outputs.to(outputs.dtype))
    grads = [hidden.grad.cpu()]
    if prompts is not None:
        grads.append(prompts.grad.cpu())
    return grads


def _allocate(config, num_blocks, batch, max_length, dtype, device) -> KVCache:
    with torch.inference_mode():
        return KVCache.allocate(config, num_blocks, batch, max_length, dtype, device)


# ---- the handler ----------------------------------------------------------------------------------------------------
class TransformerConnectionHandler(ServicerBase):
    """Petals-compatible RPCs over one served span. `served` is None while the server loads or moves."""

    def __init__(self, p2p: P2P, pool: MemoryPool, limits: ServingLimits, *, dht_client_mode: bool = False,
                 on_sessions_changed: Callable[[], None] | None = None):
        assert type(self).__name__ == HANDLER_CLASS  # the p2pd protocol names depend on it
        self.p2p = p2p
        self.pool = pool
        self.limits = limits
        self.dht_client_mode = dht_client_mode
        self.served: ServedSpan | None = None
        self.generation = 0  # bumped when the span changes: sessions on the old span end
        self.sessions: dict[str, _Session] = {}
        self.compute = PriorityWorker()
        self.quotas = Quotas(limits.quotas())
        self.on_sessions_changed = on_sessions_changed or (lambda: None)
        self.requests_served = 0
        self.tokens_served = 0  # rows × tokens of every request served (core/swarm/contribution.py)
        self.pushed_steps_served = 0  # steps that came from the previous server rather than the client
        self.inline_steps = 0  # steps run on the event loop (the inline shortcut)

    def set_span(self, served: ServedSpan | None) -> None:
        self.served = served
        self.generation += 1

    def close(self) -> None:
        self.compute.close()

    def end_sessions(self) -> None:
        """End every open session at its next read, as if its client had closed it (a pausing server)."""
        for session in list(self.sessions.values()):
            try:
                session.inbox.put_nowait(None)
            except asyncio.QueueFull:
                pass  # unread steps: the next one finds the span gone and ends the session

    # -- helpers ------------------------------------------------------------------------------------------------------
    def _require_served(self) -> ServedSpan:
        if self.served is None:
            raise ProtocolError("this server is not serving blocks right now (loading, moving or paused); try another")
        return self.served

    def _chain(self, uid: str, served: ServedSpan) -> tuple[int, int]:
        indices = parse_chain_uid(uid, served.dht_prefix)
        start, end = indices[0], indices[-1] + 1
        if indices != list(range(start, end)):
            raise ProtocolError(f"uid chain {clip(uid)} is not a run of consecutive blocks")
        if start < served.start or end > served.end:
            raise ProtocolError(
                f"blocks {start}:{end} are not served here (this server serves {served.start}:{served.end})"
            )
        return start, end

    def cache_tokens_left(self) -> int:
        served = self.served
        if served is None:
            return 0
        per_token = KVCache.nbytes_for(served.config, served.end - served.start, 1, 1, served.dtype)
        return max(0, self.pool.free_bytes // max(1, per_token))

    async def _run(self, fn, *args, priority: int = INFERENCE):
        return await self.compute.run(priority, fn, *args)

    def _decode(self, tensors: list[runtime_pb2.Tensor], metadata: dict) -> tuple:
        """Wire tensors + args_structure -> positional arguments (within the request size limit)."""
        total = sum(len(t.buffer) for t in tensors)
        if total > self.limits.max_request_bytes:
            raise ProtocolError(f"request of {total} bytes exceeds the limit of {self.limits.max_request_bytes}")
        args, _kwargs = unpack_args([deserialize_tensor(t) for t in tensors], metadata.get("args_structure"))
        return args

    def _parse_step(self, tensors: list[runtime_pb2.Tensor], metadata: dict, served: ServedSpan, start: int,
                    end: int, batch: int | None = None) -> _Step:
        return self._check_step(self._decode(tensors, metadata), served, start, end, batch)

    def _check_step(self, args: tuple, served: ServedSpan, start: int, end: int, batch: int | None = None) -> _Step:
        """(hidden_states, prompts, hypo_ids) checked against the served model; ProtocolError names what is wrong."""
        if not args or not isinstance(args[0], torch.Tensor):
            raise ProtocolError("the request carries no hidden_states tensor")
        hidden = args[0]
        hidden_size = served.config.hidden_size
        if hidden.dim() != 3 or hidden.shape[2] != hidden_size or not hidden.is_floating_point():
            raise ProtocolError(
                f"hidden_states must be a float tensor [batch, tokens, {hidden_size}], got "
                f"{hidden.dtype} {list(hidden.shape)}"
            )
        if hidden.shape[0] == 0 or (batch is not None and hidden.shape[0] != batch):
            raise ProtocolError(f"hidden_states batch {hidden.shape[0]} does not match the session's batch {batch}")
        prompts = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) and args[1].numel() else None
        if prompts is not None:
            expected = (end - start, hidden.shape[0], hidden_size)
            if prompts.dim() != 4 or (prompts.shape[0], prompts.shape[1], prompts.shape[3]) != expected:
                raise ProtocolError(f"prompts must be [{end - start}, batch, prefix, {hidden_size}], got "
                                    f"{list(prompts.shape)}")
            if not prompts.is_floating_point():
                raise ProtocolError("prompts must be a float tensor")
        hypo_ids = args[2] if len(args) > 2 and isinstance(args[2], torch.Tensor) and args[2].numel() else None
        if hypo_ids is not None:
            if hypo_ids.dtype not in (torch.int64, torch.int32) or hypo_ids.shape != (hidden.shape[0],):
                raise ProtocolError(f"hypo_ids must be int64 [{hidden.shape[0]}], got {hypo_ids.dtype} "
                                    f"{list(hypo_ids.shape)}")
            if int(hypo_ids.min()) < 0 or int(hypo_ids.max()) >= hidden.shape[0]:
                raise ProtocolError("hypo_ids must index rows of the batch")
            hypo_ids = hypo_ids.long()
        return _Step(hidden, prompts, hypo_ids)

    # -- rpc_info ----------------------------------------------------------------------------------------------------
    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        info = {
            "version": PROTOCOL_VERSION,
            "dht_client_mode": self.dht_client_mode,
            "cache_tokens_available": self.cache_tokens_left(),
            # our own diagnostics (other readers ignore unknown keys)
            "hivekeeper_stats": {"sessions": len(self.sessions), "requests_served": self.requests_served,
                                 "tokens_served": self.tokens_served,
                                 "pushed_steps_served": self.pushed_steps_served,
                                 "busy_refusals": self.quotas.refused},
        }
        if request.uid:
            served = self._require_served()
            self._chain(request.uid, served)
            info.update(block_schemas(served.config.hidden_size, served.dtype))
        return runtime_pb2.ExpertInfo(serialized_info=pack_metadata(info))

    # -- rpc_forward / rpc_backward ----------------------------------------------------------------------------------
    async def _forward(self, uid: str, tensors, metadata: dict, unary: str | None = None) -> list[torch.Tensor]:
        """A forward's output; for a unary call (`unary` names its method) one too big to answer is refused first."""
        served = self._require_served()
        start, end = self._chain(uid, served)
        step = self._parse_step(tensors, metadata, served, start, end)
        if step.hidden.shape[0] * step.hidden.shape[1] > self.limits.max_forward_tokens:
            raise ProtocolError(f"batch × tokens {step.hidden.shape[0] * step.hidden.shape[1]} exceeds the limit "
                                f"of {self.limits.max_forward_tokens}")
        if step.hidden.shape[1] > served.config.max_position_embeddings:
            raise ProtocolError(f"{step.hidden.shape[1]} tokens exceed the model's context")
        if unary:
            unary_output_fits(step.hidden.numel(), served.dtype, self._compressions(metadata, 1)[0], unary)
        self.requests_served += 1
        self.tokens_served += step.hidden.shape[0] * step.hidden.shape[1]
        return [await self._forward_in_tasks(served, start, end, step)]

    async def _forward_in_tasks(self, served: ServedSpan, start: int, end: int, step: _Step) -> torch.Tensor:
        """A forward as compute tasks of one block and at most FORWARD_TASK_ROWS rows (whole sequences) each: an
        inference step queued behind it waits for one such task, not for the whole forward."""
        hidden = step.hidden
        per_task = max(1, FORWARD_TASK_ROWS // max(1, hidden.shape[1]))  # sequences per task
        for i in range(start, end):
            parts = []
            for first in range(0, hidden.shape[0], per_task):
                rows = slice(first, first + per_task)
                prompts = step.prompts[i - start : i - start + 1, rows] if step.prompts is not None else None
                parts.append(await self._run(_forward, served.sub(i, i + 1), _Step(hidden[rows], prompts, None),
                                             priority=FORWARD))
            hidden = torch.cat(parts) if len(parts) > 1 else parts[0]
        return hidden.cpu()

    async def _backward(self, uid: str, tensors, metadata: dict, unary: str | None = None) -> list[torch.Tensor]:
        served = self._require_served()
        start, end = self._chain(uid, served)
        args = self._decode(tensors, metadata)
        # (inputs, grad_outputs[, prompts]): inputs and prompts get the same checks as a forward's
        if len(args) < 2 or not all(isinstance(a, torch.Tensor) for a in args[:2]):
            raise ProtocolError("backward needs (hidden_states, grad_outputs[, prompts])")
        grad_outputs = args[1]
        step = self._check_step((args[0], *args[2:3]), served, start, end)
        if grad_outputs.shape != step.hidden.shape or not grad_outputs.is_floating_point():
            raise ProtocolError(f"grad_outputs must match hidden_states {list(step.hidden.shape)}, got "
                                f"{list(grad_outputs.shape)}")
        if step.hidden.shape[0] * step.hidden.shape[1] > self.limits.max_forward_tokens:
            raise ProtocolError(f"batch × tokens exceeds the limit of {self.limits.max_forward_tokens}")
        self.requests_served += 1
        self.tokens_served += step.hidden.shape[0] * step.hidden.shape[1]
        return await self._run(_backward, served.sub(start, end), step, grad_outputs, priority=FORWARD)

    @staticmethod
    def _compressions(metadata: dict, count: int) -> list[int]:
        """The output_compression asked for each of `count` outputs (NONE where absent or unknown)."""
        compressions = metadata.get("output_compression")
        if not isinstance(compressions, (tuple, list)) or len(compressions) != count:
            compressions = [runtime_pb2.CompressionType.NONE] * count
        valid = set(runtime_pb2.CompressionType.values())
        return [c if isinstance(c, int) and c in valid else runtime_pb2.CompressionType.NONE for c in compressions]

    def _response(self, outputs: list[torch.Tensor], metadata: dict) -> list[runtime_pb2.Tensor]:
        return [serialize_tensor(t, c) for t, c in zip(outputs, self._compressions(metadata, len(outputs)))]

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return await self._guard(self._unary(self._forward, request, context, "rpc_forward"), "forward", context)

    async def rpc_forward_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                                 context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        messages = await self._guard(self._streamed(self._forward, requests, context), "forward_stream", context)
        for message in messages:
            yield message

    async def rpc_backward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return await self._guard(self._unary(self._backward, request, context, "rpc_backward"), "backward", context)

    async def rpc_backward_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                                  context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        messages = await self._guard(self._streamed(self._backward, requests, context), "backward_stream", context)
        for message in messages:
            yield message

    async def _unary(self, run, request: runtime_pb2.ExpertRequest, context: P2PContext,
                     method: str) -> runtime_pb2.ExpertResponse:
        """A unary forward/backward within the peer's quotas; a response too big for a unary message is refused
        (the client calls the _stream variant) rather than lost and leaked inside hivemind."""
        with self.quotas.request(str(context.remote_id)) as charge:
            charge.add(sum(len(t.buffer) for t in request.tensors))
            metadata = unpack_metadata(request.metadata)
            outputs = await run(request.uid, list(request.tensors), metadata, unary=method)
            response = runtime_pb2.ExpertResponse(tensors=self._response(outputs, metadata))
        unary_response_size_ok(response, method)
        return response

    async def _streamed(self, run, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext) -> list:
        """A streamed forward/backward within the peer's quotas (bytes charged as parts arrive): response messages."""
        with self.quotas.request(str(context.remote_id)) as charge:
            uid, tensors, metadata = await read_stream(requests, self.limits.max_request_bytes, charge.add)
            outputs = await run(uid, tensors, metadata)
            return list(stream_messages(self._response(outputs, metadata), runtime_pb2.ExpertResponse))

    async def _guard(self, coro, what: str, context: P2PContext):
        """Await coro; log a bad request in one line (the caller gets the exception text as its error)."""
        try:
            return await coro
        except (ProtocolError, InputError, AllocationFailed) as exc:
            logger.info("rejected %s from %s: %s", what, str(context.remote_id)[-8:], exc)
            raise

    # -- rpc_push ----------------------------------------------------------------------------------------------------
    async def rpc_push(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """A previous server hands us the input of a step of one of our sessions (server-to-server pipelining).
        Accepted only from the session's upstream peer, with a step_id (so that a step runs once per session however
        the chain loops) and a bounded next_servers; a full inbox answers busy."""
        return await self._guard(self._push(request, context), "push", context)

    async def _push(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        metadata = unpack_metadata(request.metadata)
        session = self.sessions.get(_check_id(metadata.get("session_id"), "session_id", required=True))
        if session is None:
            raise ProtocolError(f"push for unknown session {clip(metadata.get('session_id'))}")
        _check_id(metadata.get("step_id"), "a pushed step's step_id", required=True)
        _check_next_servers(metadata, self.limits)
        session.check_pusher(str(context.remote_id))
        metadata["pushed"] = True
        pushed = runtime_pb2.ExpertRequest(uid=request.uid, tensors=request.tensors, metadata=pack_metadata(metadata))
        try:
            session.inbox.put_nowait(pushed)
        except asyncio.QueueFull:
            raise ServerBusy(f"the session has {session.inbox.qsize()} unread steps") from None
        return runtime_pb2.ExpertResponse()

    async def _push_next(self, output: torch.Tensor, metadata: dict) -> None:
        """Send our step output to the next server of the client's chain (best effort: the client sends it too)."""
        next_servers = metadata.get("next_servers")
        if not next_servers or metadata.get("step_id") is None:
            return  # a step without a step_id could run again at each turn of a looping chain: not passed on
        try:
            peer_id, session_id, start, end = next_servers[0]
            served_prefix = self.served.dht_prefix if self.served else None
            message = push_request(output, chain_uid(served_prefix, int(start), int(end)), session_id,
                                   metadata.get("step_id"), tuple(next_servers[1:]))
            await asyncio.wait_for(self.p2p.call_protobuf_handler(
                PeerID.from_base58(peer_id), handler_name("rpc_push"), message, runtime_pb2.ExpertResponse), 5.0)
        except Exception as exc:  # the client delivers the step anyway
            logger.debug("push to the next server failed: %s", exc)

    # -- rpc_inference -----------------------------------------------------------------------------------------------
    async def rpc_inference(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                            context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """One session: the first request opens it (max_length, session_id, alloc_timeout), each request is a step."""
        try:
            first = await asyncio.wait_for(requests.__anext__(), self.limits.step_timeout)
        except (StopAsyncIteration, asyncio.TimeoutError):
            return
        try:
            opening = self._check_opening(first)
        except (ProtocolError, InputError) as exc:
            logger.info("rejected inference from %s: %s", str(context.remote_id)[-8:], exc)
            raise
        if opening is None:
            return  # an empty first request opens nothing
        with self.quotas.session(str(context.remote_id)):
            async with contextlib.aclosing(self._serve_session(opening, requests, context)) as responses:
                async for response in responses:
                    yield response

    def _check_opening(self, first: runtime_pb2.ExpertRequest) -> _Opening | None:
        """The first request's blocks, metadata and step checked; None for an empty one."""
        served = self._require_served()
        generation = self.generation
        metadata = unpack_metadata(first.metadata)
        start, end = self._chain(first.uid, served)
        max_length = _session_max_length(metadata, self.limits)
        alloc_timeout = _alloc_timeout(metadata, self.limits)
        session_id = metadata.get("session_id")
        if not isinstance(session_id, str) or not session_id or len(session_id) > MAX_ID_CHARS \
                or session_id in self.sessions:
            session_id = str(uuid.uuid4())  # absent, odd or clashing: pushes cannot reach this session then
        _check_id(metadata.get("upstream_peer"), "upstream_peer")
        _check_id(metadata.get("step_id"), "step_id")
        _check_next_servers(metadata, self.limits)
        if len(self.sessions) >= self.limits.max_sessions:
            raise ServerBusy(f"{len(self.sessions)} sessions open (limit {self.limits.max_sessions})")
        if not first.tensors:
            return None
        step = self._parse_step(list(first.tensors), metadata, served, start, end)
        return _Opening(served, generation, start, end, max_length, alloc_timeout, session_id, metadata, step)

    async def _serve_session(self, opening: _Opening, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                             context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Register the session, reserve and allocate its cache, answer its steps; a bad step, a timeout or a failed
        reservation ends it (logged, raised to the client)."""
        nbytes = opening.cache_bytes
        upstream = opening.metadata.get("upstream_peer")
        session = _Session(opening.session_id, asyncio.Queue(self.limits.max_unread_steps), upstream,
                           upstream is not None)
        self.sessions[session.session_id] = session
        pump_task = asyncio.create_task(_pump(requests, session.inbox))
        deadline = time.monotonic() + self.limits.session_timeout
        try:
            async with self.pool.reserve(nbytes, opening.alloc_timeout):
                self.on_sessions_changed()
                live = await self._start_session(opening, session, deadline)
                async with contextlib.aclosing(self._session_steps(live)) as responses:
                    async for response in responses:
                        yield response
        except (ProtocolError, InputError, AllocationFailed) as exc:
            logger.info("inference session %s from %s ended: %s", session.session_id[:8],
                        str(context.remote_id)[-8:], exc)
            raise
        finally:
            pump_task.cancel()
            self.sessions.pop(session.session_id, None)
            self.on_sessions_changed()

    async def _start_session(self, opening: _Opening, session: _Session, deadline: float) -> _LiveSession:
        served, blocks = opening.served, opening.end - opening.start
        cache = await self._run(_allocate, served.config, blocks, opening.batch, opening.max_length, served.dtype,
                                served.device)
        return _LiveSession(opening, session, served.sub(opening.start, opening.end), cache, deadline)

    async def _session_steps(self, live: _LiveSession) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Each step not run before (by step_id): run, answered, passed on to the next server; then the next one."""
        step, step_meta = live.opening.step, live.opening.metadata
        while True:
            if live.session.first_time(step_meta.get("step_id")):
                output = await self._run_step(live, step, step_meta)
                yield runtime_pb2.ExpertResponse(tensors=[serialize_tensor(output)])
                self._pass_on(output, step, step_meta)
            step, step_meta = await self._next_step(live)
            if step is None:
                return  # the client closed the session

    async def _run_step(self, live: _LiveSession, step: _Step, step_meta: dict) -> torch.Tensor:
        """One step on the session's cache, on the compute thread (or right here when it is known to be tiny)."""
        if self.generation != live.opening.generation:
            raise ProtocolError("this server moved to other blocks; re-route the session")
        start_from = _start_position(live, step, step_meta)
        started = time.perf_counter()
        if step.hidden.shape[1] <= 1 and live.inline_estimate(step) < INLINE_STEP_SECONDS:
            # a step estimated tiny from its own shape runs right here: a thread hop would cost more than it
            self.inline_steps += 1
            output = _inference_step(live.span, live.cache, step, start_from)
        else:
            output = await self._run(_inference_step, live.span, live.cache, step, start_from)
        live.measured(step, time.perf_counter() - started)
        self.requests_served += 1
        self.tokens_served += step.hidden.shape[0] * step.hidden.shape[1]
        self.pushed_steps_served += bool(step_meta.get("pushed"))
        return output

    def _pass_on(self, output: torch.Tensor, step: _Step, step_meta: dict) -> None:
        """Pipelining: hand the output straight to the next server of the client's chain. Only plain steps: a
        pushed copy carries no hypo_ids, prompts or rewind."""
        if (step_meta.get("next_servers") and step.hypo_ids is None and step.prompts is None
                and step_meta.get("start_from_position") is None):
            asyncio.create_task(self._push_next(output, step_meta))

    async def _next_step(self, live: _LiveSession) -> tuple[_Step | None, dict]:
        """The session's next request (the client's or a pushed one), checked; (None, {}) once the client closed."""
        request = await self._next_request(live)
        if request is None or not request.tensors:
            return None, {}
        step_meta = unpack_metadata(request.metadata)
        _check_id(step_meta.get("step_id"), "step_id")
        _check_next_servers(step_meta, self.limits)
        opening = live.opening
        step = self._parse_step(list(request.tensors), step_meta, opening.served, opening.start, opening.end,
                                opening.batch)
        return step, step_meta

    async def _next_request(self, live: _LiveSession) -> runtime_pb2.ExpertRequest | None:
        session_timeout = ProtocolError(f"session exceeded the server's session timeout of "
                                        f"{self.limits.session_timeout:g}s")
        remaining = live.deadline - time.monotonic()
        if remaining <= 0:
            raise session_timeout
        try:
            # asyncio.timeout, not wait_for: no task per step wrapped around the get
            async with asyncio.timeout(min(self.limits.step_timeout, remaining)):
                return await live.session.inbox.get()
        except TimeoutError:
            if remaining <= self.limits.step_timeout:
                raise session_timeout from None  # the session's time ran out first, not the step's
            raise ProtocolError(f"no step within the step timeout of {self.limits.step_timeout:g}s") from None
