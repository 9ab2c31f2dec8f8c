"""The swarm client: read the swarm from the DHT, route, run inference sessions that survive server failures.

    model = SwarmModel("path/or/org-name", initial_peers=[...])    # embeddings and head run locally
    with model.inference_session(max_length=128) as session:          # KVCache-like: .length, .truncate, .reorder
        hidden = model.span(model.embedding(ids), session)            # all blocks, through the swarm
        logits = model.head(hidden)

Fault tolerance: each server session keeps every input it was sent. When a server fails (its stream breaks, it
answers an error, or it misses the step deadline) the client bans it with backoff, routes that server's blocks
again and replays the history to the replacement(s) in one step, so the generation continues exactly. Each such
failover is recorded (`SwarmClient.failovers`: server, blocks, replayed tokens, when, how long it took).

When some blocks have no server that answers and none is joining to serve them, the client says so early: after
gap_seconds (5 s) it raises SwarmGap, which names the blocks and since when they have had no server, instead of
waiting retry_seconds (60 s) for one. A caller that streamed the text so far still has it (`hivekeeper generate`
prints it before the error).

The network side runs on an asyncio loop in a background thread; the public API is synchronous.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Coroutine

import torch
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PHandlerError
from hivemind.proto import runtime_pb2

from hivekeeper.core.swarm.dht import (MAX_RPS, RemoteSpanInfo, ServerState, check_initial_peers, read_blocks,
                                       served_span, spans_of)
from hivekeeper.core.swarm.dht import ping as ping_server
from hivekeeper.core.swarm.protocol import (
    DTYPES,
    STREAM_SWITCH_BYTES,
    chain_uid,
    deserialize_tensor,
    handler_name,
    is_busy,
    new_event_loop,
    pack_args,
    pack_metadata,
    serialize_tensor,
    stream_messages,
    combine_parts,
)
from hivekeeper.core.swarm.client.routing import (BanList, Hop, NoRoute, block_ranges, route_forward,
                                                   route_inference, uncovered_blocks)
from hivekeeper.core.swarm.client.spot_check import LocalReferee, SpotCheckConfig, first_mismatch, tolerance
from hivekeeper.planner.errors import InputError

logger = logging.getLogger("hivekeeper.swarm.client")


class SwarmError(InputError):
    """The swarm could not serve a request (no servers for some blocks, or every retry failed).

    An InputError, so that the CLI reports it in one line: the swarm named by --initial-peers cannot run this model
    right now."""


class SwarmGap(SwarmError):
    """Some blocks have no server that answers, and no server is joining to serve them.

    blocks: the block indices without a server; since: the wall-clock time from which they have had none (the last
    answer of the server that held them, or when the client first looked)."""

    def __init__(self, blocks: list[int], since: float, cause: str = ""):
        self.blocks, self.since = list(blocks), since
        when = time.strftime("%H:%M:%S", time.localtime(since))
        ago = max(0.0, time.time() - since)
        super().__init__(f"no server covers block {self.blocks[0]}: blocks {block_ranges(self.blocks)} have had no "
                         f"server that answers since {when} ({ago:.1f} s ago){cause}")


@dataclass
class ClientConfig:
    initial_peers: tuple[str, ...]
    dht_prefix: str
    num_blocks: int  # blocks in the model
    host: str = "127.0.0.1"  # a client only dials out; it listens on loopback
    step_timeout: float = 5.0  # seconds for an inference step, plus the expected compute time × 10 ...
    max_step_timeout: float = 30.0  # ... but never more than this plus tokens × blocks / slowest_rps, whatever
    slowest_rps: float = 20.0  # ... speed a server claims (a claim of 1e-9 tokens/s cannot hold a client for long)
    forward_timeout: float = 60.0  # seconds for a forward pass through one server
    connect_timeout: float = 5.0
    alloc_timeout: float = 5.0  # seconds a server may wait for cache room before refusing our session
    ban_seconds: float = 15.0  # first ban of a failing peer; doubles per failure
    retry_seconds: float = 60.0  # give up when no route works for this long
    gap_seconds: float = 5.0  # ... or this soon when some blocks have no answering server and none is joining
    swarm_cache_seconds: float = 10.0  # reuse a DHT read this long
    ping_timeout: float = 2.0  # for RTT measurements when routing
    probe_interval: float = 0.5  # while a step is late, check the server is alive this often
    probe_timeout: float = 1.0  # a liveness probe unanswered this long means the server is gone
    fresh_seconds: float = 2.0  # when re-routing, servers not heard from this long are probed first
    # ask servers to pass each step's output straight to the next server: saves a client round trip per hop on
    # real networks, but costs CPU; on a loaded 2-core loopback box it made steps slower (18 vs 15 ms), so opt-in
    use_push: bool = False
    spot_check_rate: float = 0.125  # the fraction of steps whose outputs are recomputed elsewhere (spot_check.py)
    spot_check_local_blocks: int = 4  # recompute locally spans up to this long, when the client has the weights


class _LoopThread:
    """An asyncio loop on a daemon thread; run(coro) blocks the caller until the coroutine is done."""

    def __init__(self):
        self.loop = new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="hivekeeper-swarm", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine, timeout: float | None = None) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()
            raise

    def stop(self) -> None:
        async def cancel_the_rest() -> None:  # hivemind leaves background tasks (DHT refreshes) behind
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        try:
            self.run(cancel_the_rest(), timeout=5)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()


def first_line(error: BaseException, width: int) -> str:
    """An error in one short line (daemon errors carry multi-line dial reports)."""
    text = (str(error) or type(error).__name__).strip().splitlines()[0]
    return text if len(text) <= width else text[: width - 1] + "…"


def describe_server(hop: Hop) -> str:
    """'...q6HGvQ34 (its public name)': how messages name a server."""
    name = hop.span.info.public_name
    return f"...{hop.peer_id[-8:]}" + (f" ({name})" if name else "")


_STEP_STRUCTURE = ((b"__T0", b"__T1", b"__T2"), {})  # pack_args(hidden_states, prompts, hypo_ids)


class DeepPrompts:
    """A session's deep prompts (fine-tuning's deep_ptune, core/finetune): [blocks, batch, prefix, hidden] for its
    blocks [start, end), added inside each block to the input at positions 0..prefix-1. Set by the step that starts
    the session with them; every server session of it (the route's, a failover's replacements, a spot check's
    referees) sends its blocks' slice with each step that covers those positions: the first step, a replay from 0,
    a rewind into them. A server adds a step's prompts to the step's first positions (Petals' rule), so a step from
    position p < prefix gets the prompts of positions p..prefix-1."""

    def __init__(self, start: int):
        self.start = start
        self.tensor: torch.Tensor | None = None

    def set(self, prompts: torch.Tensor, blocks: int, batch: int, hidden: torch.Tensor) -> None:
        expected = (blocks, batch, hidden.shape[2])
        if prompts.dim() != 4 or (prompts.shape[0], prompts.shape[1], prompts.shape[3]) != expected:
            raise InputError(f"deep prompts must be [{blocks}, {batch}, prefix, {hidden.shape[2]}], got "
                             f"{list(prompts.shape)}")
        self.tensor = prompts.detach().float().cpu()

    def reorder(self, hypo_ids: torch.Tensor | None) -> None:
        if self.tensor is not None and hypo_ids is not None:
            self.tensor = self.tensor[:, hypo_ids]

    def slice(self, start: int, end: int, position: int) -> torch.Tensor | None:
        """Blocks [start, end)'s prompts for a step from `position` (None when it covers none of them)."""
        if self.tensor is None or position >= self.tensor.shape[2]:
            return None
        return self.tensor[start - self.start : end - self.start, :, position:]


@functools.lru_cache(maxsize=None)
def _empty_wire(dtype: torch.dtype) -> runtime_pb2.Tensor:
    return serialize_tensor(torch.empty(0, dtype=dtype))


def _kept(buffer: torch.Tensor | None, hidden: torch.Tensor, length: int,
          hypo_ids: torch.Tensor | None) -> torch.Tensor:
    """The buffer with `hidden` written at positions [length, length + tokens): a buffer that doubles when full (a
    concatenation per step would copy the whole history every token), rows reordered first for a beam search."""
    batch, tokens, width = hidden.shape
    if buffer is not None and hypo_ids is not None:
        buffer = buffer[hypo_ids]  # beam search: row i continues the old row hypo_ids[i]
    if buffer is not None and (buffer.shape[0], buffer.shape[2]) != (batch, width):
        raise InputError(f"hidden states {list(hidden.shape)} do not continue this session's batch of "
                         f"{buffer.shape[0]} rows of width {buffer.shape[2]}")
    if buffer is None or buffer.shape[1] < length + tokens:
        grown = torch.empty(batch, max(16, 2 * (length + tokens)), width, dtype=torch.float32)
        if buffer is not None:
            grown[:, :length] = buffer[:, :length]
        buffer = grown
    buffer.narrow(1, length, tokens).copy_(hidden.detach())  # kept in full precision for replays
    return buffer


# ---- one server's part of a session ----------------------------------------------------------------------------------
class _ServerSession:
    """A stream to one server running blocks [start, end) for one session; keeps the inputs it was sent."""

    def __init__(self, client: "SwarmClient", hop: Hop, max_length: int, prompts: DeepPrompts | None = None):
        self.client, self.hop, self.max_length = client, hop, max_length
        self.prompts = prompts  # the session's deep prompts: this server's slice goes with steps that cover them
        self.session_id = str(uuid.uuid4())
        # every input sent, for replay: the first `_length` positions of a buffer that doubles when full (a
        # concatenation per step would copy the whole history every token)
        self._history_buffer: torch.Tensor | None = None  # [batch, capacity, hidden], fp32
        self._length = 0
        self._output_buffer: torch.Tensor | None = None  # its answers, kept like the inputs
        self.upstream: str | None = None  # the peer before it in the chain (set before it opens): its only pusher
        self.checked = 0  # positions whose outputs a spot check confirmed
        self.referee: dict | None = None  # its spot checks' referee: a local KV cache or remote sessions, and length
        self.expected_seconds = 0.0
        self.answered_at: float | None = None  # wall-clock time of its last answer
        self._inbox: asyncio.Queue | None = None
        self._responses: AsyncIterator | None = None
        dtype_name = hop.span.info.torch_dtype or "float32"
        self.wire_dtype = DTYPES.get(dtype_name, torch.float32)

    @property
    def length(self) -> int:
        return self._length

    @property
    def history(self) -> torch.Tensor | None:
        """[batch, length, hidden]: the inputs this server was sent, in order (None before the first)."""
        return None if self._history_buffer is None else self._history_buffer[:, : self._length]

    async def _open(self) -> None:
        self._inbox = asyncio.Queue()

        async def requests():
            while True:
                request = await self._inbox.get()
                if request is None:
                    return
                yield request

        self._responses = await asyncio.wait_for(self.client.p2p.iterate_protobuf_handler(
            PeerID.from_base58(self.hop.peer_id), handler_name("rpc_inference"), requests(),
            runtime_pb2.ExpertResponse), self.client.config.connect_timeout)

    def _compute_seconds(self, tokens: int) -> float:
        """Expected compute time of a step from the server's advertised speed (a claim that is not a finite positive
        number counts as 1 token/s; one above MAX_RPS as MAX_RPS)."""
        info = self.hop.span.info
        claims = (info.forward_rps, info.inference_rps, info.throughput) if tokens > 1 else \
            (info.inference_rps, info.throughput)
        rps = next((float(c) for c in claims if isinstance(c, (int, float)) and math.isfinite(c) and c > 0), 1.0)
        return tokens * (self.hop.end - self.hop.start) / min(rps, MAX_RPS)

    def _timeout(self, tokens: int) -> float:
        """step_timeout + 10 × the expected compute time, within a ceiling that no claimed speed moves:
        max_step_timeout + tokens × blocks / slowest_rps."""
        config = self.client.config
        ceiling = config.max_step_timeout + tokens * (self.hop.end - self.hop.start) / config.slowest_rps
        self.expected_seconds = min(self._compute_seconds(tokens), ceiling)
        return min(config.step_timeout + 10.0 * self.expected_seconds, max(ceiling, config.step_timeout))

    @property
    def opened(self) -> bool:
        return self._responses is not None

    async def step(self, hidden: torch.Tensor, hypo_ids: torch.Tensor | None = None, start_from: int | None = None,
                   step_id: str | None = None, next_servers: list | None = None) -> torch.Tensor:
        """Send one step ([batch, tokens, hidden]) and wait for the output of our last block.

        next_servers: (peer, session_id, start, end) of the servers after this one, for server-to-server push."""
        metadata: dict = {"session_id": self.session_id, "step_id": step_id or str(uuid.uuid4())}
        if next_servers:
            metadata["next_servers"] = tuple(tuple(server) for server in next_servers)
        if self._responses is None:
            await self._open()
            metadata.update(max_length=self.max_length, alloc_timeout=self.client.config.alloc_timeout)
            if self.upstream is not None:  # the server then takes pushes from that peer only (docs/swarm.md)
                metadata["upstream_peer"] = self.upstream
        if start_from is not None:
            metadata["start_from_position"] = start_from
        # (hidden_states, prompts, hypo_ids); the empty ones are the same bytes every step
        metadata["args_structure"] = _STEP_STRUCTURE
        prompts = self._prompts_from(self._length if start_from is None else min(start_from, self._length))
        wire_prompts = _empty_wire(self.wire_dtype) if prompts is None else \
            serialize_tensor(prompts.to(self.wire_dtype))
        tensors = [serialize_tensor(hidden.to(self.wire_dtype)), wire_prompts,
                   serialize_tensor(hypo_ids) if hypo_ids is not None else _empty_wire(torch.int64)]
        uid = chain_uid(self.client.config.dht_prefix, self.hop.start, self.hop.end)
        self._inbox.put_nowait(runtime_pb2.ExpertRequest(uid=uid, tensors=tensors, metadata=pack_metadata(metadata)))
        response = await self._await_response(self._timeout(hidden.shape[1]))
        if len(response.tensors) != 1:
            raise ConnectionError(f"server {self.hop.peer_id[-8:]} answered {len(response.tensors)} tensors")
        output = deserialize_tensor(response.tensors[0])
        if output.shape != hidden.shape:
            raise ConnectionError(f"server {self.hop.peer_id[-8:]} answered shape {list(output.shape)} "
                                  f"for input {list(hidden.shape)}")
        self.client.heard_from(self.hop.peer_id)
        self.answered_at = time.time()
        self._remember(hidden, hypo_ids, start_from, output)
        return output

    def _prompts_from(self, position: int) -> torch.Tensor | None:
        """Our blocks' deep prompts for a step from `position` (DeepPrompts.slice), or None."""
        return None if self.prompts is None else self.prompts.slice(self.hop.start, self.hop.end, position)

    async def _await_response(self, timeout: float) -> runtime_pb2.ExpertResponse:
        """The next response, within `timeout`. While it is late, probe the server every probe_interval: a server
        whose process died can leave its stream open (its p2pd lives on), and a probe finds that out in ~1 s."""
        pending = asyncio.ensure_future(self._responses.__anext__())
        deadline = time.monotonic() + timeout
        probe_at = time.monotonic() + max(self.client.config.probe_interval, 3 * self.expected_seconds)
        try:
            while True:
                wait = min(probe_at, deadline) - time.monotonic()
                probe_at += self.client.config.probe_interval
                done, _ = await asyncio.wait({pending}, timeout=max(0.0, wait))
                if done:
                    try:
                        return pending.result()
                    except StopAsyncIteration:
                        raise ConnectionError(f"server {self.hop.peer_id[-8:]} closed the session") from None
                if time.monotonic() >= deadline:
                    raise asyncio.TimeoutError(f"server {self.hop.peer_id[-8:]} missed the {timeout:.1f}s deadline")
                try:
                    await self.client.ping(self.hop.peer_id, self.client.config.probe_timeout)
                except Exception as exc:
                    raise ConnectionError(f"server {self.hop.peer_id[-8:]} stopped answering ({exc!r})") from None
        finally:
            if not pending.done():
                pending.cancel()

    def _remember(self, hidden: torch.Tensor, hypo_ids: torch.Tensor | None, start_from: int | None,
                  output: torch.Tensor | None = None) -> None:
        length = self._length if start_from is None else min(start_from, self._length)
        self._history_buffer = _kept(self._history_buffer, hidden, length, hypo_ids)
        if output is not None:
            self._output_buffer = _kept(self._output_buffer, output, length, hypo_ids)
        self._length = length + hidden.shape[1]
        # outputs past a rewind are new: checked again; rows reordered (beam search): everything is
        self.checked = 0 if hypo_ids is not None else min(self.checked, length)

    @property
    def outputs(self) -> torch.Tensor | None:
        """[batch, length, hidden]: what this server answered for each position (for spot checks)."""
        return None if self._output_buffer is None else self._output_buffer[:, : self._length]

    async def drop_referee(self) -> None:
        """Forget the spot checks' referee (closing its sessions, if remote): the next check starts a new one."""
        state, self.referee = self.referee, None
        if state is not None and state["kind"] == "remote":
            await asyncio.gather(*(s.close() for s in state["sessions"]), return_exceptions=True)

    async def close(self, goodbye: bool = True) -> None:
        """End the stream. goodbye: send the protocol's empty request first and let the server end its side (Petals
        servers log a stream that just ends as an error); False for a server that already failed."""
        if self._inbox is not None:
            if goodbye and self._responses is not None:
                self._inbox.put_nowait(runtime_pb2.ExpertRequest())
            self._inbox.put_nowait(None)
        if self._responses is not None:
            if goodbye:
                try:
                    await asyncio.wait_for(self._responses.__anext__(), 1.0)
                except Exception:
                    pass
            try:
                await asyncio.wait_for(self._responses.aclose(), 1.0)
            except Exception:
                pass
            self._responses = None


# ---- a session over many servers -------------------------------------------------------------------------------------
class _InferenceCore:
    """An inference session over blocks [start, end), as a list of server sessions (async, on the client loop)."""

    def __init__(self, client: "SwarmClient", max_length: int, batch: int, start: int = 0, end: int | None = None):
        self.client, self.max_length, self.batch = client, max_length, batch
        self.start, self.end = start, client.config.num_blocks if end is None else end
        self.sessions: list[_ServerSession] = []
        self.position = 0
        self.prompts = DeepPrompts(self.start)  # deep prompts, once a step brings them
        self.recoveries: list[dict] = []  # this session's failovers (as SwarmClient.failovers)
        self.mismatches: list[int] = []  # first wrong positions found by spot checks, not yet taken by the caller
        self.steps = 0
        self.closed = False

    def route(self) -> list[tuple[str, int, int]]:
        return [(s.hop.peer_id, s.hop.start, s.hop.end) for s in self.sessions]

    async def _new_sessions(self, start: int, end: int, deadline: float, fresh: bool = False,
                            since: float | None = None, cause: str = "",
                            exclude: frozenset = frozenset()) -> list[_ServerSession]:
        """Sessions for blocks [start, end) along the best route; waits for servers up to the deadline, or
        gap_seconds from `since` (wall-clock; default: now) when no answering server covers some block and none is
        joining to (SwarmGap, with `cause` appended to its message).

        fresh: (after a failure) probe every candidate not heard from in the last seconds first, so that a server
        that died earlier but is still listed in the DHT is not chosen again."""
        client, config = self.client, self.client.config
        max_age, timeout = (config.fresh_seconds, config.probe_timeout) if fresh else (60.0, config.ping_timeout)

        def usable(peer: str) -> bool:
            return not client.bans.banned(peer) and client.heard_within(peer, max_age) and peer not in exclude

        known_gap = since is None  # no failed server to date the gap from: a gap this client saw before, else now
        since = time.time() if since is None else since
        refresh, warned = False, False
        while True:
            view = await client.view(refresh=refresh)
            candidates = {s.peer_id for s in view.spans if s.start < end and s.end > start
                          and not client.bans.banned(s.peer_id) and s.peer_id not in exclude}
            # probe the candidates we have not heard from lately, all at once; route as soon as the ones that
            # answered cover the blocks (a dead server's probe then runs out in the background and bans it)
            pending = {asyncio.create_task(client.measure(peer, timeout))
                       for peer in candidates if not client.heard_within(peer, max_age)}
            while True:
                try:
                    hops = route_inference(view.spans, start, end, rtts=client.known_rtts(),
                                           cache_tokens_needed=self.batch * self.max_length,
                                           banned=lambda peer: not usable(peer))
                    for block in range(start, end):
                        client.gap_since.pop(block, None)
                    return [_ServerSession(client, hop, self.max_length, self.prompts) for hop in hops]
                except NoRoute as exc:
                    if not pending:
                        no_route = exc
                        break
                    _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            missing = uncovered_blocks(view.spans, start, end, usable=usable) or list(range(start, end))
            nobody_joins = set(uncovered_blocks(view.joining, start, end, usable=lambda p: not client.bans.banned(p)))
            hopeless = [block for block in missing if block in nobody_joins]
            if hopeless and time.time() - since >= min(config.gap_seconds, config.retry_seconds):
                # (waited gap_seconds from this look all the same: a server back since the last report must have
                # the time to appear in a fresh view of the swarm)
                first = min([since, *(client.gap_since[b] for b in hopeless if b in client.gap_since)]) \
                    if known_gap else since
                for block in hopeless:
                    client.gap_since.setdefault(block, first)
                raise SwarmGap(hopeless, first, cause)  # nobody serves them and nobody is coming: say so now
            if time.monotonic() > deadline:  # (at once for a spot check's referee: no warning then)
                raise SwarmError(f"{no_route}; waited {config.retry_seconds:g}s for a server") from None
            if not warned:
                warned = True
                logger.warning("blocks %s have no server that answers; waiting for one%s", block_ranges(missing),
                               "" if hopeless else " (a server is joining to serve them)")
            refresh = True
            await asyncio.sleep(1.0)

    async def step(self, hidden: torch.Tensor, hypo_ids: torch.Tensor | None = None,
                   start_from: int | None = None, prompts: torch.Tensor | None = None) -> torch.Tensor:
        """One step through every server; prompts: deep prompts [blocks, batch, prefix, hidden] for positions
        0..prefix-1, with the session's first step only (DeepPrompts)."""
        if self.closed:
            raise SwarmError("the inference session is closed")
        position = self.position if start_from is None else start_from
        if position + hidden.shape[1] > self.max_length:
            raise InputError(f"{position + hidden.shape[1]} tokens exceed the session's max_length {self.max_length}")
        if prompts is not None:
            if position != 0:
                raise InputError("deep prompts go with a session's first step (positions from 0)")
            self.prompts.set(prompts, self.end - self.start, self.batch, hidden)
        self.prompts.reorder(hypo_ids)
        deadline = time.monotonic() + self.client.config.retry_seconds
        if not self.sessions:
            self.sessions = await self._new_sessions(self.start, self.end, deadline)
        # one step_id for the whole chain: a server pushes its output to the next one, which starts at once and
        # skips the copy we send after it (plain steps on open sessions only; see docs/swarm.md)
        step_id = str(uuid.uuid4())
        push = (self.client.config.use_push and hypo_ids is None and start_from is None
                and all(s.opened for s in self.sessions))
        x, index = hidden, 0
        while index < len(self.sessions):
            session = self.sessions[index]
            next_servers = [(s.hop.peer_id, s.session_id, s.hop.start, s.hop.end)
                            for s in self.sessions[index + 1:]] if push else None
            if not session.opened:
                session.upstream = self.sessions[index - 1].hop.peer_id if index else None
            try:
                x = await session.step(x, hypo_ids, start_from, step_id, next_servers)
                index += 1
                continue
            except InputError:
                raise
            except Exception as exc:  # a broken stream, an error answer, a missed deadline: route around it
                failure = exc
            x, replaced = await self._recover(index, x, hypo_ids, start_from, failure, deadline)
            index += replaced
        self.position = position + hidden.shape[1]
        if self.client.spot_checks.due(self.steps) and hypo_ids is None:
            x = await self._spot_check(x, deadline)
        self.steps += 1
        return x

    # ---- spot checks (spot_check.py) --------------------------------------------------------------------------------
    async def _spot_check(self, output: torch.Tensor, deadline: float) -> torch.Tensor:
        """Check each server's outputs since its last check; after a mismatch, the step's output as honest servers
        give it (the liar replaced, the servers after it recomputed from the first wrong position)."""
        index = 0
        while index < len(self.sessions):
            session = self.sessions[index]
            if session.checked < session.length:
                verdict = await self._referee(session)
                if verdict is not None:
                    position, record = verdict
                    if position is None:
                        session.checked = session.length
                    else:
                        output, replaced = await self._replace_liar(index, position, record, output, deadline)
                        index += replaced
                        continue
            index += 1
        return output

    async def _referee(self, session: _ServerSession) -> tuple[int | None, dict] | None:
        """(first wrong position or None, the check's record), or None when nobody can check this server now.

        Locally when the client has the weights; else on another server, and when it disagrees a third decides: the
        one the other two outvote is banned for good (a liar may be the referee). With no third, the dispute is
        recorded and nobody is banned. The first referee (local cache or remote sessions) stays with the session,
        so that each check recomputes only the positions since the last one."""
        start, end = session.hop.start, session.hop.end
        inputs, outputs, checked = session.history, session.outputs, session.checked
        own_dtype = session.hop.span.info.torch_dtype
        local = self.client.local_referee
        if local is not None and local.covers(start, end):
            state = session.referee if session.referee and session.referee["kind"] == "local" else None
            cache = state["cache"] if state else local.allocate(start, end, inputs.shape[0], session.max_length)
            offset = min(state["length"], checked) if state else 0
            tail = await asyncio.get_running_loop().run_in_executor(None, local.extend, start, end, cache, offset,
                                                                    inputs[:, offset:],
                                                                    self.prompts.slice(start, end, offset))
            session.referee = {"kind": "local", "cache": cache, "length": session.length}
            return self._compare(session, outputs, tail, offset, "local", (own_dtype,))
        first = await self._remote_referee(session, inputs, checked)
        if first is None:
            return None
        tail, offset, referees, dtypes = first
        position, record = self._compare(session, outputs, tail, offset, ",".join(referees), (own_dtype, *dtypes))
        if position is None:
            return None, record
        second = await self._remote_reference(start, end, inputs, {session.hop.peer_id, *referees})
        if second is None:
            record.update(ok=None, unresolved=True)  # one against one: nobody is banned
            return None, record
        atol, rtol = tolerance(own_dtype, *dtypes, *second[2])
        sides_with_referee = first_mismatch(second[0][:, checked:], tail[:, checked - offset:], atol, rtol)[0] is None
        record["second_referee"] = ",".join(second[1])
        if sides_with_referee:
            return position, record
        for peer in referees:  # the first referee was outvoted: it is the liar, the checked server is right
            self.client.bans.forever(peer)
            logger.warning("server %s gave wrong outputs as a referee for blocks %d:%d; banned", peer[-8:], start, end)
        await session.drop_referee()
        record.update(ok=True, outvoted_referee=referees)
        return None, record

    def _compare(self, session: _ServerSession, outputs: torch.Tensor, tail: torch.Tensor, offset: int,
                 referee: str, dtypes: tuple) -> tuple[int | None, dict]:
        """Compare the outputs since the last check with a referee's outputs for positions [offset, length)."""
        atol, rtol = tolerance(*dtypes)
        checked = session.checked
        position, largest = first_mismatch(outputs[:, checked:], tail[:, checked - offset:], atol, rtol)
        record = {"peer_id": session.hop.peer_id, "blocks": [session.hop.start, session.hop.end],
                  "referee": referee, "time": time.time(), "checked_positions": [checked, session.length],
                  "max_diff": largest, "atol": atol, "rtol": rtol, "ok": position is None}
        self.client.spot_check_log.append(record)
        return (None if position is None else checked + position), record

    async def _remote_referee(self, session: _ServerSession, inputs: torch.Tensor,
                              checked: int) -> tuple[torch.Tensor, int, list[str], list] | None:
        """The session's referee servers (opened on first use, kept after) over the inputs since `checked` (or
        since what they last saw): (their outputs, the position those start at, their peer ids, their dtypes)."""
        state = session.referee if session.referee and session.referee["kind"] == "remote" else None
        if state is None:
            try:
                others = await self._new_sessions(session.hop.start, session.hop.end, time.monotonic(),
                                                  exclude=frozenset({session.hop.peer_id}))
            except SwarmError:
                return None  # no other server covers these blocks now
            state = session.referee = {"kind": "remote", "sessions": others, "length": 0}
        offset = min(state["length"], checked)
        try:
            x = inputs[:, offset:]
            for other in state["sessions"]:
                x = await other.step(x, None, offset if offset < other.length else None)
        except InputError:
            raise
        except Exception:  # the referee failed: no verdict this time, another referee next time
            await session.drop_referee()
            return None
        state["length"] = session.length
        others = state["sessions"]
        return x, offset, [o.hop.peer_id for o in others], [o.hop.span.info.torch_dtype for o in others]

    async def _remote_reference(self, start: int, end: int, inputs: torch.Tensor,
                                exclude: set[str]) -> tuple[torch.Tensor, list[str], list] | None:
        """Blocks [start, end) over all of `inputs` on other servers (fresh sessions, closed after; for a dispute):
        (outputs, their peer ids, their dtypes), or None if no other server covers them now or one fails."""
        try:
            others = await self._new_sessions(start, end, time.monotonic(), exclude=frozenset(exclude))
        except SwarmError:
            return None
        try:
            reference = inputs
            for other in others:
                reference = await other.step(reference)
        except InputError:
            raise
        except Exception:
            return None
        finally:
            for other in others:
                await other.close()
        return reference, [o.hop.peer_id for o in others], [o.hop.span.info.torch_dtype for o in others]

    async def _replace_liar(self, index: int, position: int, check: dict, output: torch.Tensor,
                            deadline: float) -> tuple[torch.Tensor, int]:
        """Ban the server for good, replay its inputs on a replacement, recompute the servers after it from
        `position`; returns the step's output and how many sessions stand in the liar's place."""
        liar, tokens = self.sessions[index], output.shape[1]
        started, found_at = time.monotonic(), time.time()
        self.client.bans.forever(liar.hop.peer_id)
        logger.warning("server %s gave wrong outputs for blocks %d:%d from position %d (max diff %.3g, checked by "
                       "%s); banned, replaying on another server", liar.hop.peer_id[-8:], liar.hop.start,
                       liar.hop.end, position, check["max_diff"], check["referee"])
        await liar.drop_referee()
        await liar.close(goodbye=False)
        replacements = await self._new_sessions(liar.hop.start, liar.hop.end, deadline, fresh=True)
        x = liar.history
        for session in replacements:
            x = await session.step(x)
        self.sessions[index : index + 1] = replacements
        x = x[:, position:]
        for session in self.sessions[index + len(replacements):]:
            x = await session.step(x, None, position)
        for session in replacements:
            session.checked = session.length  # what a referee computed is what they answered: no need to re-check
        self.mismatches.append(position)
        failover = {"peer_id": liar.hop.peer_id, "public_name": liar.hop.span.info.public_name,
                    "blocks": [liar.hop.start, liar.hop.end], "replayed_tokens": liar.length, "time": found_at,
                    "seconds": time.monotonic() - started,
                    "error": f"spot check: wrong outputs from position {position} (max diff {check['max_diff']:.3g})",
                    "new_route": [(s.hop.peer_id, s.hop.start, s.hop.end) for s in replacements],
                    "spot_check": {**check, "first_wrong_position": position}}
        self.recoveries.append(failover)
        self.client.failovers.append(failover)
        return x[:, -tokens:], len(replacements)

    async def _recover(self, index: int, x: torch.Tensor, hypo_ids, start_from, failure: Exception,
                       deadline: float) -> tuple[torch.Tensor, int]:
        """Replace the failed session `index` by a new route over its blocks; replay its history plus this step.

        Returns the step output of the replacement chain and how many sessions now stand in its place.
        """
        failed = self.sessions[index]
        started, failed_at = time.monotonic(), time.time()
        if await self.client.record_lied(failed.hop, failure):
            logger.warning("server %s does not serve blocks %d:%d that a DHT record gave it (%s); not banned, "
                           "re-routing by what it confirms", failed.hop.peer_id[-8:], failed.hop.start,
                           failed.hop.end, first_line(failure, 80))
        elif is_busy(failure):  # an honest "busy": route around it now, without counting a failure
            ban = self.client.bans.busy(failed.hop.peer_id)
            logger.info("server %s is busy on blocks %d:%d (%s); skipped for %.0fs, re-routing",
                        failed.hop.peer_id[-8:], failed.hop.start, failed.hop.end, first_line(failure, 80), ban)
        else:
            ban = self.client.bans.fail(failed.hop.peer_id)
            logger.warning("server %s failed on blocks %d:%d (%s); banned for %.0fs, re-routing",
                           failed.hop.peer_id[-8:], failed.hop.start, failed.hop.end, failure, ban)
        await failed.drop_referee()
        await failed.close(goodbye=False)
        history = failed.history
        if history is not None:
            if start_from is not None:
                history = history[:, :start_from]
            if hypo_ids is not None:
                history = history[hypo_ids]
        replay_len = 0 if history is None else history.shape[1]
        cause = f"; the server that held them, {describe_server(failed.hop)}, failed: {first_line(failure, 80)}"
        while True:
            replacements = await self._new_sessions(failed.hop.start, failed.hop.end, deadline, fresh=True,
                                                    since=failed.answered_at or failed_at, cause=cause)
            inputs = x if history is None else torch.cat([history.to(x.dtype), x], dim=1)
            try:
                out = inputs
                for session in replacements:
                    out = await session.step(out)
                break
            except InputError:
                raise
            except Exception as exc:  # a replacement failed too: ban it and try again
                bad = next((s for s in replacements if s.length == 0), replacements[-1])
                self.client.bans.fail(bad.hop.peer_id)
                logger.warning("replacement %s failed too (%s)", bad.hop.peer_id[-8:], exc)
                for session in replacements:
                    await session.close(goodbye=session is not bad)
                if time.monotonic() > deadline:
                    raise SwarmError(f"could not recover blocks {failed.hop.start}:{failed.hop.end}: {exc}") from exc
        self.sessions[index : index + 1] = replacements
        seconds = time.monotonic() - started
        failover = {"peer_id": failed.hop.peer_id, "public_name": failed.hop.span.info.public_name,
                    "blocks": [failed.hop.start, failed.hop.end], "replayed_tokens": replay_len, "time": failed_at,
                    "seconds": seconds, "error": first_line(failure, 200),
                    "new_route": [(s.hop.peer_id, s.hop.start, s.hop.end) for s in replacements]}
        self.recoveries.append(failover)
        self.client.failovers.append(failover)
        logger.warning("recovered blocks %d:%d in %.2fs (replayed %d tokens)", failed.hop.start, failed.hop.end,
                       seconds, replay_len)
        return out[:, replay_len:], len(replacements)

    async def close(self) -> None:
        self.closed = True
        await asyncio.gather(*(s.drop_referee() for s in self.sessions), return_exceptions=True)
        await asyncio.gather(*(s.close() for s in self.sessions), return_exceptions=True)


class RemoteSession:
    """An inference session through the swarm, shaped like a KVCache: `length`, `truncate(n)`, `reorder(ids)`.

    The session's KV cache lives on the servers; truncate/reorder are sent with the next step.
    """

    def __init__(self, client: "SwarmClient", max_length: int, batch: int = 1):
        if max_length <= 0:
            raise InputError(f"max_length must be positive, got {max_length}")
        self.client = client
        self.max_length, self.batch = max_length, batch
        self._core = _InferenceCore(client, max_length, batch)
        self._start_from: int | None = None
        self._hypo_ids: torch.Tensor | None = None
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    @property
    def recoveries(self) -> list[dict]:
        return self._core.recoveries

    @property
    def route(self) -> list[tuple[str, int, int]]:
        """(peer_id, start, end) of each server the session currently uses."""
        return self._core.route()

    def take_mismatch(self) -> int | None:
        """The first position whose outputs a spot check found wrong since the last call (None if none): outputs
        from there on, and whatever the caller chose from them, came from a liar (now replaced)."""
        found, self._core.mismatches = self._core.mismatches, []
        return min(found) if found else None

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise InputError(f"cannot rewind the session to {length} tokens: it holds {self._length}")
        self._length = length
        self._start_from = length

    def reorder(self, hypo_ids: torch.Tensor) -> None:
        hypo_ids = hypo_ids.to(torch.int64).cpu()
        if hypo_ids.shape != (self.batch,):
            raise InputError(f"hypo_ids must have shape ({self.batch},), got {tuple(hypo_ids.shape)}")
        self._hypo_ids = hypo_ids if self._hypo_ids is None else self._hypo_ids[hypo_ids]

    def step(self, hidden: torch.Tensor, prompts: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [batch, new_tokens, hidden] -> the hidden states after the model's last block. prompts: deep
        prompts [blocks, batch, prefix, hidden] with the first step (fine-tuning's deep_ptune; DeepPrompts)."""
        if hidden.dim() != 3 or hidden.shape[0] != self.batch:
            raise InputError(f"hidden states must be [{self.batch}, tokens, hidden], got {tuple(hidden.shape)}")
        device, dtype = hidden.device, hidden.dtype
        output = self.client.run(self._core.step(hidden.detach().cpu(), self._hypo_ids, self._start_from, prompts))
        self._start_from, self._hypo_ids = None, None
        self._length += hidden.shape[1]
        return output.to(device=device, dtype=dtype)

    def close(self) -> None:
        if not self._core.closed:
            self.client.run(self._core.close())

    def __enter__(self) -> "RemoteSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- the client ----------------------------------------------------------------------------------------------------
@dataclass
class SwarmView:
    """What the DHT says now: per block {peer: ServerInfo}, each ONLINE server's span and each JOINING one's."""

    blocks: list[dict]
    spans: list[RemoteSpanInfo]
    joining: list[RemoteSpanInfo] = field(default_factory=list)
    read_at: float = field(default_factory=time.monotonic)


class SwarmClient:
    """A client peer of the swarm (P2P + a client-mode DHT node on a background loop)."""

    def __init__(self, config: ClientConfig):
        if not config.initial_peers:
            raise InputError("the swarm client needs --initial-peers (multiaddrs printed by `hivekeeper serve`)")
        check_initial_peers(config.initial_peers)
        self.config = config
        self.bans = BanList(config.ban_seconds)
        self.failovers: list[dict] = []  # every failover of every session: server, blocks, replayed tokens, time
        self.p2p: P2P | None = None
        self.dht: DHTNode | None = None
        self._view: SwarmView | None = None
        self._rtts: dict[str, tuple[float, float]] = {}  # peer -> (rtt, measured at)
        self.refused: set[str] = set()  # peers that answered but refused blocks their record listed
        # block -> since when it has had no answering server, as a SwarmGap said: a later session (a chat's /retry)
        # dates the same gap from then, not from its own first look; cleared once the block is routed again
        self.gap_since: dict[int, float] = {}
        self.spot_checks = SpotCheckConfig(config.spot_check_rate, config.spot_check_local_blocks)
        self.spot_check_log: list[dict] = []  # every spot check: server, blocks, referee, positions, max diff, ok
        self.local_referee: LocalReferee | None = None  # set by SwarmModel, which has the weights
        self._confirmed: dict[tuple, tuple] = {}  # (peer, listed blocks) -> (span it confirmed or None, when)
        self._thread = _LoopThread()
        try:
            self.run(self._connect())
        except BaseException:
            self._thread.stop()
            raise

    def run(self, coro: Coroutine, timeout: float | None = None) -> Any:
        return self._thread.run(coro, timeout)

    async def _connect(self) -> None:
        peers = list(self.config.initial_peers)
        try:
            self.p2p = await P2P.create(initial_peers=peers, host_maddrs=[f"/ip4/{self.config.host}/tcp/0"])
            self.dht = await DHTNode.create(p2p=self.p2p, initial_peers=peers, client_mode=True, num_workers=8,
                                            cache_locally=False)
        except Exception as exc:
            if self.p2p is not None:
                await self.p2p.shutdown()
            raise InputError(f"cannot join the swarm at {', '.join(peers)}: {exc}") from None

    def close(self) -> None:
        if self.p2p is None:
            return
        self.run(self._shutdown())
        self._thread.stop()

    async def _shutdown(self) -> None:
        if self.dht is not None:
            try:
                await asyncio.wait_for(self.dht.shutdown(), 5.0)
            except Exception:
                pass
        await self.p2p.shutdown()
        self.p2p = None

    # ---- the swarm as the DHT sees it -------------------------------------------------------------------------------
    async def view(self, refresh: bool = False) -> SwarmView:
        cached = self._view
        if cached is not None and not refresh and time.monotonic() - cached.read_at < self.config.swarm_cache_seconds:
            return cached
        blocks = await read_blocks(self.dht, self.config.dht_prefix, self.config.num_blocks)
        online = spans_of(blocks, states=(ServerState.ONLINE,))
        doubted = self._doubted(blocks)
        confirmed = await self._confirm(blocks, doubted)
        spans = {**{peer: span for peer, span in online.items() if peer not in doubted}, **confirmed}
        joining = [span for peer, span in spans_of(blocks, states=(ServerState.JOINING,)).items()
                   if peer not in spans]
        self._view = SwarmView(blocks, list(spans.values()), joining)
        return self._view

    def _doubted(self, blocks: list[dict]) -> set[str]:
        """Peers whose records are not believed without asking them: listed OFFLINE somewhere (forged or honest: a
        server that answers for its blocks is serving them), listed with an expiration too far ahead, or refusing
        blocks a record gave them (`refused`)."""
        listed_offline = {peer for servers in blocks for peer, info in servers.items()
                          if info.state == ServerState.OFFLINE}
        return listed_offline | (self.refused & {peer for servers in blocks for peer in servers})

    async def _confirm(self, blocks: list[dict], peers: set[str]) -> dict[str, RemoteSpanInfo]:
        """The doubted peers that confirm serving some of the blocks they are listed on (rpc_info, a short timeout,
        all at once; an answer is reused for fresh_seconds), as ONLINE spans of what they confirmed."""
        async def one(peer: str) -> tuple[str, tuple[int, int] | None]:
            listed = tuple(i for i, servers in enumerate(blocks) if peer in servers)
            known = self._confirmed.get((peer, listed))
            if known is not None and time.monotonic() - known[1] < self.config.fresh_seconds:
                return peer, known[0]
            span = await served_span(self.p2p, peer, self.config.dht_prefix, list(listed), self.config.probe_timeout)
            self._confirmed[(peer, listed)] = (span, time.monotonic())
            return peer, span

        confirmed = {}
        for peer, span in await asyncio.gather(*(one(peer) for peer in sorted(peers))):
            if span is None:
                continue
            records = [blocks[i][peer] for i in range(*span)]
            info = dataclasses.replace(next((r for r in records if r.suspect is None), records[0]),
                                       state=ServerState.ONLINE, start_block=span[0], end_block=span[1])
            confirmed[peer] = RemoteSpanInfo(peer, span[0], span[1], info)
        return confirmed

    async def record_lied(self, hop: Hop, failure: Exception) -> bool:
        """After a server answered a step with an error: does it still answer, but not serve the blocks its record
        gave it (a forged record)? Then it is not banned (that would leave a gap where it does serve): it goes to
        `refused`, and routing uses only the blocks it confirms itself. Other failures (no answer, a broken stream,
        a missed deadline) are the server's own."""
        if not isinstance(failure, P2PHandlerError):
            return False
        span = await served_span(self.p2p, hop.peer_id, self.config.dht_prefix, list(range(hop.start, hop.end)),
                                 self.config.probe_timeout)
        if span == (hop.start, hop.end):
            return False
        self.refused.add(hop.peer_id)
        self._view = None  # the next route reads the records again and confirms this peer's blocks first
        return True

    async def spans(self, refresh: bool = False) -> list[RemoteSpanInfo]:
        return (await self.view(refresh)).spans

    async def ping(self, peer_id: str, timeout: float | None = None) -> tuple[float, dict]:
        """(round-trip seconds, rpc_info dict) of one server; one that does not answer is no longer 'heard'."""
        try:
            rtt, info = await ping_server(self.p2p, peer_id, timeout or self.config.ping_timeout)
        except BaseException:
            self._rtts.pop(peer_id, None)
            raise
        self._rtts[peer_id] = (rtt, time.monotonic())
        return rtt, info

    def heard_from(self, peer_id: str) -> None:
        """A server just answered: it counts as alive (its RTT stays as measured)."""
        if peer_id in self._rtts:
            self._rtts[peer_id] = (self._rtts[peer_id][0], time.monotonic())

    def heard_within(self, peer_id: str, seconds: float) -> bool:
        entry = self._rtts.get(peer_id)
        return entry is not None and time.monotonic() - entry[1] <= seconds

    def known_rtts(self) -> dict[str, float]:
        return {peer: rtt for peer, (rtt, _) in self._rtts.items()}

    async def measure(self, peer_id: str, timeout: float | None = None) -> bool:
        """Ping a server; one that does not answer is banned. True if it answered."""
        try:
            await self.ping(peer_id, timeout)
            return True
        except Exception as exc:
            self.bans.fail(peer_id)
            logger.info("server %s does not answer (%s); banned", peer_id[-8:], type(exc).__name__)
            return False

    async def rtts(self, peers: list[str], max_age: float = 0.0,
                   timeout: float | None = None) -> dict[str, float | None]:
        """Each peer's round-trip seconds, or None if it does not answer (it gets banned). Peers heard from within
        max_age seconds are not pinged again; by default all are, so that a server that died since is seen now."""
        await asyncio.gather(*(self.measure(p, timeout) for p in set(peers) if not self.heard_within(p, max_age)))
        return {p: self._rtts[p][0] if p in self._rtts else None for p in peers}

    # ---- forward (no cache) -----------------------------------------------------------------------------------------
    async def _forward_hop(self, hop: Hop, hidden: torch.Tensor) -> torch.Tensor:
        return await self.forward_hop(hop, hidden)

    async def forward_hop(self, hop: Hop, hidden: torch.Tensor, prompts: torch.Tensor | None = None) -> torch.Tensor:
        """One server's blocks over hidden [batch, tokens, hidden], no cache; prompts: deep prompts
        [hop blocks, batch, prefix, hidden] added to each block's first positions (fine-tuning), or None."""
        dtype = self._hop_dtype(hop)
        empty = torch.empty(0, dtype=dtype)
        outputs = await self._call_hop(hop, "rpc_forward", hidden.to(dtype),
                                       prompts.to(dtype) if prompts is not None else empty)
        if len(outputs) != 1 or outputs[0].shape != hidden.shape:
            raise ConnectionError(f"server {hop.peer_id[-8:]} answered {[list(t.shape) for t in outputs]} "
                                  f"for input {list(hidden.shape)}")
        return outputs[0]

    async def backward_hop(self, hop: Hop, hidden: torch.Tensor, grad_outputs: torch.Tensor,
                           prompts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(gradient of the hop's input, of its deep prompts or None), given the gradient of its output: Petals'
        rpc_backward with (inputs, grad_outputs[, prompts])."""
        dtype = self._hop_dtype(hop)
        args = (hidden.to(dtype), grad_outputs.to(dtype)) + ((prompts.to(dtype),) if prompts is not None else ())
        grads = await self._call_hop(hop, "rpc_backward", *args)
        if len(grads) != 1 + (prompts is not None) or grads[0].shape != hidden.shape or \
                (prompts is not None and grads[1].shape != prompts.shape):
            raise ConnectionError(f"server {hop.peer_id[-8:]} answered gradients {[list(g.shape) for g in grads]}")
        return grads[0].float(), grads[1].float() if prompts is not None else None

    @staticmethod
    def _hop_dtype(hop: Hop) -> torch.dtype:
        return DTYPES.get(hop.span.info.torch_dtype or "float32", torch.float32)

    async def _call_hop(self, hop: Hop, method: str, *args: torch.Tensor) -> list[torch.Tensor]:
        """rpc_forward / rpc_backward (`method`) of one server with these tensors: unary when small, else its
        _stream variant; the answer's tensors."""
        tensors, structure = pack_args(*args)
        serialized = [serialize_tensor(t) for t in tensors]
        metadata = pack_metadata({"args_structure": structure})
        uid = chain_uid(self.config.dht_prefix, hop.start, hop.end)
        peer = PeerID.from_base58(hop.peer_id)
        timeout = self.config.forward_timeout
        if sum(len(t.buffer) for t in serialized) <= STREAM_SWITCH_BYTES:
            response = await asyncio.wait_for(self.p2p.call_protobuf_handler(
                peer, handler_name(method), runtime_pb2.ExpertRequest(uid=uid, tensors=serialized,
                                                                      metadata=metadata),
                runtime_pb2.ExpertResponse), timeout)
            parts = list(response.tensors)
        else:
            def make(**fields):
                return runtime_pb2.ExpertRequest(uid=uid, **fields)

            async def requests():
                for message in stream_messages(serialized, make, metadata):
                    yield message

            async def collect():
                responses = await self.p2p.iterate_protobuf_handler(
                    peer, handler_name(f"{method}_stream"), requests(), runtime_pb2.ExpertResponse)
                return [part async for response in responses for part in response.tensors]

            parts = await asyncio.wait_for(collect(), timeout)
        return [deserialize_tensor(t) for t in combine_parts(parts)]

    async def forward(self, hidden: torch.Tensor, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Blocks [start, end) over hidden [batch, tokens, hidden], no cache; failed servers are routed around."""
        end = self.config.num_blocks if end is None else end
        deadline = time.monotonic() + self.config.retry_seconds
        position, x, refresh = start, hidden, False
        while position < end:
            try:
                hops = route_forward(await self.spans(refresh), position, end, banned=self.bans.banned)
            except NoRoute as exc:
                if time.monotonic() > deadline:
                    raise SwarmError(str(exc)) from None
                refresh = True
                await asyncio.sleep(1.0)
                continue
            for hop in hops:
                try:
                    x = await self._forward_hop(hop, x)
                    position = hop.end
                except Exception as exc:
                    if isinstance(exc, asyncio.CancelledError):
                        raise
                    self.bans.fail(hop.peer_id)
                    logger.warning("forward on %s failed (%s); re-routing", hop.peer_id[-8:], exc)
                    if time.monotonic() > deadline:
                        raise SwarmError(f"forward through blocks {position}:{end} failed: {exc}") from exc
                    break
        return x

    # ---- sessions ---------------------------------------------------------------------------------------------------
    def inference_session(self, max_length: int, batch: int = 1) -> RemoteSession:
        return RemoteSession(self, max_length, batch)


# ---- the model facade ----------------------------------------------------------------------------------------------
class RemoteSpan:
    """All blocks of the model, through the swarm, with Span's call shape: span(hidden, cache) -> hidden.

    `cache` is a RemoteSession (from `allocate_cache`) instead of a KVCache; without one it is a plain forward.
    """

    def __init__(self, client: SwarmClient, num_blocks: int):
        self.client, self.start, self.end = client, 0, num_blocks

    def allocate_cache(self, batch: int, max_length: int) -> RemoteSession:
        return self.client.inference_session(max_length, batch)

    def __call__(self, hidden: torch.Tensor, cache: RemoteSession | None = None) -> torch.Tensor:
        if cache is not None:
            return cache.step(hidden)
        device, dtype = hidden.device, hidden.dtype
        return self.client.run(self.client.forward(hidden.detach().cpu())).to(device=device, dtype=dtype)

    forward = __call__


class SwarmModel:
    """A model whose blocks run in the swarm; embeddings, final norm and LM head run here."""

    def __init__(self, model: str, *, initial_peers, dht_prefix: str | None = None,
                 dtype: str | torch.dtype = torch.float32, device: str = "cpu", **client_options):
        from hivekeeper.core.runtime.checkpoint import load_embedding, load_head, load_config, parse_dtype, resolve_checkpoint
        from hivekeeper.core.swarm.dht import dht_prefix_for

        path = resolve_checkpoint(model, blocks=(0, 0), embeddings=True)
        self.path = path
        self.config = load_config(path)
        self.dtype = parse_dtype(dtype)
        self.embedding = load_embedding(path, dtype=self.dtype, device=device)
        self.head = load_head(path, dtype=self.dtype, device=device,
                              embedding=self.embedding if self.config.tie_word_embeddings else None)
        client_config = ClientConfig(tuple(initial_peers), dht_prefix_for(model, dht_prefix), self.config.num_layers,
                                     **client_options)
        self.client = SwarmClient(client_config)
        self.client.local_referee = LocalReferee(path, self.config, client_config.spot_check_local_blocks)
        self.span = RemoteSpan(self.client, self.config.num_layers)

    def inference_session(self, max_length: int, batch: int = 1) -> RemoteSession:
        return self.client.inference_session(max_length, batch)

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, sampler=None,
                 session: RemoteSession | None = None, on_token=None) -> torch.Tensor:
        """Generate after input_ids [batch, t]: greedy (argmax) or with a core.sampling.Sampler; returns the new ids
        [batch, max_new_tokens]. on_token(step, ids) is called after each token (for streaming).

        When a spot check finds that a server's outputs were wrong from some position on, the tokens chosen from them
        are dropped and generated again (on_token is called again from the first step redone)."""
        batch, prompt_len = input_ids.shape
        own = session is None
        session = session or self.inference_session(prompt_len + max_new_tokens, batch)
        try:
            all_ids, hidden = input_ids, self.embedding(input_ids)
            while all_ids.shape[1] < prompt_len + max_new_tokens:
                logits = self.head(session.step(hidden))[:, -1]
                wrong = session.take_mismatch()
                if wrong is not None and wrong < all_ids.shape[1] - hidden.shape[1]:
                    all_ids = all_ids[:, : max(wrong + 1, prompt_len)]  # the input at `wrong` came from good outputs
                    session.truncate(wrong)
                    hidden = self.embedding(all_ids[:, wrong:])
                    continue
                next_ids = sampler(logits, all_ids) if sampler is not None else logits.argmax(dim=-1)
                all_ids = torch.cat([all_ids, next_ids[:, None]], dim=1)
                if on_token is not None:
                    on_token(all_ids.shape[1] - prompt_len - 1, next_ids)
                hidden = self.embedding(next_ids[:, None])
            return all_ids[:, prompt_len:]
        finally:
            if own:
                session.close()

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> "SwarmModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
