"""A swarm server's life: join (or start) a swarm, choose and load a span, announce it, serve, rebalance, leave.

    start P2P + DHT -> measure block speed (cached) -> choose blocks -> JOINING -> load span -> ONLINE
    -> every update_period: re-announce (cache left, next_pings); every balance_period: maybe move
    -> SIGINT/SIGTERM: OFFLINE, handlers off, DHT and P2P (p2pd) shut down.
    -> with a PauseWatch (pause.py), while a pause condition holds: OFFLINE announced (leaving), no new sessions, open
       sessions end after their current step (clients fail over, replaying their history), span and caches freed;
       when it clears: choose blocks again, JOINING, load, ONLINE.

Choosing (and rebalancing) blocks counts only the servers that answer a probe now: a server killed without a goodbye
stays listed in the DHT for two update periods, and its blocks must count as the gap they are.

Anyone can write any subkey of the DHT, so after each announcement the server reads its own record back and, if
someone overwrote it, stores its own again with an expiration just past theirs (`_guard_record`). Readers cap
expirations and confirm a server over rpc_info (dht.py), so a forgery past that cap harms no client either.

Test-only switches (environment; the loopback tests of issue 17 use them to make a real server process lie; never
set them on a real server; read when the server is made): HIVEKEEPER_TEST_RECORD (JSON: record fields to announce instead of the true ones),
HIVEKEEPER_TEST_SILENT=1 (steps never answer; rpc_info still does), HIVEKEEPER_TEST_LIAR=X (X is added to every
output of the span: well-formed, wrong hidden states; with HIVEKEEPER_TEST_LIAR_AFTER=N, from its N+1-th run on).

Everything runs on one asyncio loop; compute runs on the handler's worker thread and loading on another, so the
node keeps answering the DHT while it loads. `status` callbacks get a dict per state change (the CLI prints them,
one JSON line each with --json-status, for the GUI).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from hivekeeper.core.runtime.checkpoint import load_config, load_span, resolve_checkpoint
from hivekeeper.core.runtime.kernels.cpu_decode import forget_arrays
from hivekeeper.core.runtime.kernels.quant_kernels import QuantizedLinear
from hivekeeper.core.runtime.model import KVCache, ModelConfig
from hivekeeper.core.swarm.dht import (
    MAX_RECORD_AHEAD_S,
    ServerInfo,
    ServerState,
    block_throughputs,
    capped_claims,
    declare_blocks,
    live_peers,
    probe,
    read_blocks,
    read_own_records,
    register_model,
    spans_of,
    without_peers,
)
from hivekeeper.core.swarm.server.handler import ServedSpan, ServingLimits, TransformerConnectionHandler
from hivekeeper.core.swarm.server.memory import MemoryPool
from hivekeeper.core.swarm.server.pause import PauseWatch
from hivekeeper.core.swarm.protocol import PROTOCOL_VERSION, dtype_name
from hivekeeper.core.swarm.server.throughput import BlockSpeed, get_block_speed, network_rps_for, span_throughput
from hivekeeper.planner.errors import InputError
from hivekeeper.planner.gguf_metadata import is_gguf
from hivekeeper.planner.swarm import ServerSpan, choose_start, should_move

logger = logging.getLogger("hivekeeper.swarm.server")

IMPLEMENTATION = "hivekeeper 0.1.0"
PAUSE_DRAIN_S = 30.0  # a pausing server waits this long for its sessions to end after their current step


@dataclass
class ServerConfig:
    checkpoint: Path  # a local checkpoint folder (already resolved)
    dht_prefix: str
    repository: str | None = None  # hub id, for the public models registry
    initial_peers: tuple[str, ...] = ()  # empty = a new private swarm
    host: str = "0.0.0.0"
    port: int = 0
    announce_maddrs: tuple[str, ...] = ()
    num_blocks: int | None = None  # choose the span (and rebalance); or:
    block_indices: tuple[int, int] | None = None  # a fixed span [start, end)
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    quant: str = "none"
    public_name: str | None = None
    throughput: str | float = "auto"  # "auto" (cached measurement), "eval" (measure again) or a number
    network_bps: float | None = None  # the operator's link speed in bit/s (min of up/down), None = unknown
    cache_tokens: int | None = None  # KV pool size in tokens (per block); default as Petals
    limits: ServingLimits = field(default_factory=ServingLimits)
    update_period: float = 60.0  # re-announce period; records expire after 2 periods
    balance_period: float = 120.0  # how often a server with --num-blocks checks whether to move
    balance_quality: float = 0.75
    stats_period: float = 0.0  # >0: also emit a "stats" status this often (sessions, cache left)


class SwarmServer:
    """One serving node. `await run()` serves until `stop()` (or SIGINT/SIGTERM with install_signals)."""

    def __init__(self, config: ServerConfig, status: Callable[[dict], None] = lambda event: None,
                 pause_watch: PauseWatch | None = None):
        self.config = config
        self.pause_watch = pause_watch  # None: never pauses
        self.paused: str | None = None  # why the server is paused now
        self._pause_wake = asyncio.Event()
        self._span_lock = asyncio.Lock()  # pausing, resuming and moving change the span one at a time
        self.emit = status
        self.model_config: ModelConfig = load_config(config.checkpoint)
        self._check_config()
        self.state = ServerState.OFFLINE
        self.blocks: range | None = None
        self.speed: BlockSpeed | None = None
        self.speed_source = ""  # where the advertised throughput comes from, in words
        self.p2p: P2P | None = None
        self.dht: DHTNode | None = None
        self.handler: TransformerConnectionHandler | None = None
        self.peer_id: str | None = None
        self.maddrs: list[str] = []
        self.next_pings: dict[str, float] = {}
        self.last_announced: tuple | None = None  # (info, blocks, expiration) of the latest announcement
        self.error: str | None = None  # why the server stopped on its own, if it did
        self._stop = asyncio.Event()
        self._wake_announcer = asyncio.Event()
        self._test_record = json.loads(os.environ.get("HIVEKEEPER_TEST_RECORD") or "{}")
        self._test_silent = os.environ.get("HIVEKEEPER_TEST_SILENT") == "1"
        self._test_offset = float(os.environ.get("HIVEKEEPER_TEST_LIAR") or 0.0)
        self._test_honest_runs = int(os.environ.get("HIVEKEEPER_TEST_LIAR_AFTER") or 0)
        self._released = threading.Event()  # lets a HIVEKEEPER_TEST_SILENT step go at shutdown

    def _check_config(self) -> None:
        cfg, model = self.config, self.model_config
        if cfg.block_indices is not None:
            start, end = cfg.block_indices
            if not 0 <= start < end <= model.num_layers:
                raise InputError(f"--block-indices {start}:{end} is outside the model's {model.num_layers} blocks")
        elif cfg.num_blocks is not None and not 0 < cfg.num_blocks <= model.num_layers:
            raise InputError(f"--num-blocks {cfg.num_blocks} must be between 1 and {model.num_layers}")
        if cfg.limits.max_length > model.max_position_embeddings:
            cfg.limits.max_length = model.max_position_embeddings

    # ---- numbers ---------------------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        if self.config.block_indices is not None:
            return self.config.block_indices[1] - self.config.block_indices[0]
        return self.config.num_blocks or self.model_config.num_layers

    def cache_tokens(self) -> int:
        """KV pool size in tokens; Petals' defaults: 4096 tokens, 16384 for grouped-query models."""
        if self.config.cache_tokens is not None:
            return self.config.cache_tokens
        return 16384 if self.model_config.num_kv_heads < self.model_config.num_heads else 4096

    def pool_bytes(self) -> int:
        return KVCache.nbytes_for(self.model_config, self.num_blocks, 1, self.cache_tokens(), self.config.dtype)

    def network_rps(self) -> float | None:
        return network_rps_for(self.config.network_bps, self.model_config.hidden_size)

    def throughput(self) -> float:
        if isinstance(self.config.throughput, (int, float)):
            return float(self.config.throughput)
        return span_throughput(self.speed, self.num_blocks, self.network_rps())

    def throughput_source(self) -> str:
        """Where the advertised throughput comes from: --throughput's number, or the block measurement (when)."""
        if isinstance(self.config.throughput, (int, float)):
            return "given by --throughput"
        return self.speed_source

    def server_info(self, state: ServerState, blocks: range) -> ServerInfo:
        speed = self.speed
        return ServerInfo(
            state=state,
            throughput=self.throughput(),
            start_block=blocks.start,
            end_block=blocks.stop,
            public_name=self.config.public_name,
            version=PROTOCOL_VERSION,
            network_rps=self.network_rps(),
            forward_rps=speed.forward_rps if speed else None,
            inference_rps=speed.inference_rps if speed else None,
            adapters=(),
            torch_dtype=dtype_name(self.config.dtype),
            quant_type=self.config.quant,
            using_relay=False,
            cache_tokens_left=self.handler.cache_tokens_left() if self.handler and self.handler.served else
            self.cache_tokens(),
            next_pings=dict(self.next_pings),
            extra={"implementation": IMPLEMENTATION},
        )

    def announced_info(self, state: ServerState, blocks: range) -> ServerInfo:
        """server_info, with HIVEKEEPER_TEST_RECORD's fields in place of the true ones (tests of lying servers)."""
        info = self.server_info(state, blocks)
        for name, value in self._test_record.items():
            setattr(info, name, value)
        return info

    @property
    def update_period(self) -> float:
        """The re-announce period: records expire after two, and readers ignore expirations past MAX_RECORD_AHEAD_S."""
        return min(self.config.update_period, MAX_RECORD_AHEAD_S / 2)

    def status_event(self, state: str, **fields) -> dict:
        event = {
            "event": "status",
            "state": state,
            "time": time.time(),
            "peer_id": self.peer_id,
            "maddrs": self.maddrs,
            "dht_prefix": self.config.dht_prefix,
            "blocks": [self.blocks.start, self.blocks.stop] if self.blocks else None,
            "num_model_blocks": self.model_config.num_layers,
        }
        if self.speed is not None:
            event.update(throughput=self.throughput(), inference_rps=self.speed.inference_rps,
                         forward_rps=self.speed.forward_rps, network_rps=self.network_rps(),
                         throughput_source=self.throughput_source())
        if self.handler is not None:
            event.update(sessions=len(self.handler.sessions), cache_tokens_left=self.handler.cache_tokens_left(),
                         requests_served=self.handler.requests_served)
        event.update(fields)
        return event

    # ---- lifecycle -------------------------------------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    def install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop)

    async def run(self) -> None:
        try:
            await self._start()
            if not self._stop.is_set():
                await self._serve()
        finally:
            await self._shutdown()

    async def _start(self) -> None:
        cfg = self.config
        host_maddrs = [f"/ip4/{cfg.host}/tcp/{cfg.port}"]
        try:
            self.p2p = await P2P.create(initial_peers=list(cfg.initial_peers) or None, host_maddrs=host_maddrs,
                                        announce_maddrs=list(cfg.announce_maddrs) or None)
            self.dht = await DHTNode.create(p2p=self.p2p, initial_peers=list(cfg.initial_peers) or None,
                                            num_workers=8, cache_locally=False)
        except Exception as exc:
            raise InputError(f"cannot join the swarm at {', '.join(cfg.initial_peers) or host_maddrs[0]}: {exc}")
        self.peer_id = self.p2p.peer_id.to_base58()
        self.maddrs = [str(a) for a in await self.p2p.get_visible_maddrs()]
        self.emit(self.status_event("started"))

        self.speed = await self._block_speed()
        self.handler = TransformerConnectionHandler(self.p2p, MemoryPool(self.pool_bytes()), cfg.limits,
                                                    on_sessions_changed=self._wake_announcer.set)
        await self.handler.add_p2p_handlers(self.p2p)
        if self._stop.is_set():
            return
        self.blocks = await self._choose_blocks()
        await self._load(self.blocks)

    async def _block_speed(self) -> BlockSpeed:
        cfg = self.config
        loop = asyncio.get_running_loop()
        # the weights are here for a local folder and a GGUF (the default model too); a hub model's shards come
        # once the span is chosen, so a random block of its shapes is timed
        here = cfg.checkpoint if not cfg.repository or is_gguf(cfg.checkpoint) else None
        given = isinstance(cfg.throughput, (int, float))  # advertised as given; the block's rates are advertised too
        log = (lambda text: logger.info("%s (its forward and inference rates, which clients' step deadlines read; the "
                                        "throughput advertised is --throughput's %g)", text, cfg.throughput)
               ) if given else logger.info
        speed, cached = await loop.run_in_executor(None, lambda: get_block_speed(
            self.model_config, cfg.device, cfg.dtype, cfg.quant, checkpoint=here,
            force_measure=cfg.throughput == "eval", log=log))
        self.speed_source = speed.source_words(now=not cached)
        return speed

    async def _choose_blocks(self, exclude_self: bool = False) -> range:
        cfg = self.config
        if cfg.block_indices is not None:
            return range(*cfg.block_indices)
        blocks = await self._answering_blocks()
        if exclude_self:
            blocks = without_peers(blocks, [self.peer_id])
        start = choose_start(block_throughputs(blocks), self.num_blocks)
        return range(start, start + self.num_blocks)

    async def _answering_blocks(self) -> list[dict[str, ServerInfo]]:
        """The DHT's records of the model's blocks, without the servers that do not answer a probe now."""
        blocks = await read_blocks(self.dht, self.config.dht_prefix, self.model_config.num_layers)
        others = [peer for peer in live_peers(blocks) if peer != self.peer_id]
        silent = [peer for peer, rtt in (await probe(self.p2p, others)).items() if rtt is None]
        if silent:
            logger.info("not counting %d listed server(s) that do not answer: %s", len(silent),
                        ", ".join(peer[-8:] for peer in silent))
        return without_peers(blocks, silent)

    async def _announce(self, state: ServerState, blocks: range, timeout: float = 10.0) -> None:
        cfg = self.config
        info = self.announced_info(state, blocks)
        expiration = get_dht_time() + 2 * self.update_period
        self.last_announced = (info, blocks, expiration)
        try:
            await asyncio.wait_for(declare_blocks(self.dht, cfg.dht_prefix, blocks, self.peer_id, info, expiration),
                                   timeout)
            if cfg.repository and state != ServerState.OFFLINE:
                await asyncio.wait_for(register_model(self.dht, cfg.dht_prefix, self.model_config.num_layers,
                                                      cfg.repository, self.update_period), timeout)
        except asyncio.TimeoutError:
            logger.warning("announcing %s for blocks %d:%d timed out", state.name, blocks.start, blocks.stop)
        except Exception as exc:  # no reachable DHT peer right now: the next period tries again
            logger.warning("announcing %s for blocks %d:%d failed: %s", state.name, blocks.start, blocks.stop, exc)

    async def _guard_record(self, info: ServerInfo, blocks: range, expiration: float, timeout: float = 10.0) -> None:
        """Read our record back from the DHT; where another one stands under our subkey, store ours again with an
        expiration just past it, if that stays within MAX_RECORD_AHEAD_S (beyond, readers ignore the forgery and
        confirm us over rpc_info; we say so in a 'record_overwritten' status)."""
        try:
            found = await read_own_records(self.dht, self.config.dht_prefix, blocks, self.peer_id, timeout)
        except Exception as exc:  # no reachable DHT peer right now: the next period checks again
            logger.warning("reading our own record back failed: %s", exc)
            return
        ours = info.to_tuple()
        # another value as new as ours, or anything newer (an older value of ours is only a node not yet updated)
        forged = {block: exp for block, (value, exp) in found.items() if exp is not None and (
            exp > expiration + 1.0 or (exp >= expiration - 1.0 and _normalized(value) != _normalized(ours)))}
        if not forged:
            return
        latest = max(forged.values())
        restored = latest + 1.0 <= get_dht_time() + MAX_RECORD_AHEAD_S
        if restored:
            try:
                await asyncio.wait_for(declare_blocks(self.dht, self.config.dht_prefix, blocks, self.peer_id, info,
                                                      latest + 1.0), timeout)
            except Exception as exc:
                logger.warning("storing our record again failed: %s", exc)
                restored = False
        logger.warning("our record for block(s) %s was overwritten (expiring %.0fs ahead); %s", sorted(forged),
                       latest - get_dht_time(), "stored ours again" if restored else
                       "too far ahead to replace: readers ignore it and ask us directly")
        self.emit(self.status_event("record_overwritten", forged_blocks=sorted(forged), restored=restored))

    async def _load(self, blocks: range) -> None:
        """JOINING -> load the span (on a thread) -> ONLINE."""
        cfg = self.config
        self.state = ServerState.JOINING
        await self._announce(ServerState.JOINING, blocks)
        self.emit(self.status_event("joining"))
        loop = asyncio.get_running_loop()
        started = time.monotonic()

        def fetch_and_load():
            folder = cfg.checkpoint
            if cfg.repository:  # from the hub: only the shards of this span (a no-op for those already cached)
                folder = resolve_checkpoint(cfg.repository, blocks=(blocks.start, blocks.stop), embeddings=False)
            return load_span(folder, blocks.start, blocks.stop, dtype=cfg.dtype, device=cfg.device, quant=cfg.quant)

        span = self._test_switches(await loop.run_in_executor(None, fetch_and_load))
        self.handler.set_span(ServedSpan(span, cfg.dht_prefix, torch.device(cfg.device)))
        self.state = ServerState.ONLINE
        await self._announce(ServerState.ONLINE, blocks)
        self.emit(self.status_event("online", load_seconds=round(time.monotonic() - started, 3),
                                    weights=span_weights(span)))

    def _test_switches(self, span):
        """HIVEKEEPER_TEST_SILENT / HIVEKEEPER_TEST_LIAR (module docstring): hooks on the loaded span; none by default."""
        if self._test_silent:
            span.register_forward_pre_hook(lambda module, args: self._released.wait(3600))
        if self._test_offset:
            runs = [0]

            def lie(module, args, output):
                runs[0] += 1
                return output + self._test_offset if runs[0] > self._test_honest_runs else output

            span.register_forward_hook(lie)
        return span

    async def _serve(self) -> None:
        tasks = [asyncio.create_task(self._announce_loop())]
        if self.config.block_indices is None and self.config.balance_period > 0:
            tasks.append(asyncio.create_task(self._balance_loop()))
        if self.config.stats_period > 0:
            tasks.append(asyncio.create_task(self._stats_loop()))
        if self.pause_watch is not None:
            tasks.append(asyncio.create_task(self._pause_loop()))
        stopped = asyncio.create_task(self._stop.wait())
        try:
            # serve until asked to stop, or until a background loop dies (then shut down cleanly and say why)
            done, _ = await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stopped and task.exception() is not None:
                    logger.error("server loop failed: %r; shutting down", task.exception())
                    self.error = str(task.exception())
                    self.emit(self.status_event("error", error=self.error))
        finally:
            stopped.cancel()
            for task in tasks:
                task.cancel()
            await self._wait_for_loops(tasks)

    async def _wait_for_loops(self, tasks: list[asyncio.Task]) -> None:
        """The cancelled background loops, awaited at most LOOPS_STOP_S: one stuck in a call that does not end on
        cancellation must not keep the server (and its p2pd) from shutting down."""
        done, stuck = await asyncio.wait(tasks, timeout=LOOPS_STOP_S)
        for task in done:
            if not task.cancelled():
                task.exception()  # retrieved: its error was said when it ended the serving
        if stuck:
            logger.warning("%d background loop(s) still running %g s after the stop; shutting down without them",
                           len(stuck), LOOPS_STOP_S)

    async def _announce_loop(self) -> None:
        period = self.update_period
        next_full = time.monotonic() + min(period, 5.0)  # first RTTs to the next servers soon after joining
        while True:
            timeout = max(0.0, next_full - time.monotonic())
            try:
                # a session opening or closing changes cache_tokens_left: re-announce soon (rate-limited)
                await asyncio.wait_for(self._wake_announcer.wait(), timeout)
                await asyncio.sleep(min(5.0, period / 4))
            except asyncio.TimeoutError:
                pass
            self._wake_announcer.clear()
            if time.monotonic() >= next_full:
                await self._measure_next_pings()
                next_full = time.monotonic() + period
            if self.state == ServerState.ONLINE and self.blocks is not None:
                await self._announce(ServerState.ONLINE, self.blocks)
                await self._guard_record(*self.last_announced)

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.stats_period)
            self.emit(self.status_event("stats"))

    async def _measure_next_pings(self) -> None:
        """RTTs (rpc_info round trips) to up to 5 servers that hold the block right after our span."""
        if self.blocks is None or self.blocks.stop >= self.model_config.num_layers:
            self.next_pings = {}
            return
        try:
            blocks = await read_blocks(self.dht, self.config.dht_prefix, self.model_config.num_layers)
        except Exception:
            return
        peers = [p for p, info in blocks[self.blocks.stop].items()
                 if p != self.peer_id and info.state == ServerState.ONLINE][:5]
        self.next_pings = {peer: rtt for peer, rtt in (await probe(self.p2p, peers)).items() if rtt is not None}

    async def _balance_loop(self) -> None:
        cfg = self.config
        while True:
            # jitter keeps servers that joined together from all moving at the same moment
            await asyncio.sleep(cfg.balance_period * random.uniform(0.7, 1.3))
            if self.state != ServerState.ONLINE:
                continue
            try:
                new_start = await self._should_move()
            except Exception as exc:
                logger.warning("balance check failed: %s", exc)
                continue
            if new_start is None or self._span_lock.locked():
                continue
            async with self._span_lock:
                await self._move(new_start)

    async def _move(self, new_start: int) -> None:
        """Move the span to start at new_start (sessions on the old one re-route); back to the old one if that fails."""
        if self.state != ServerState.ONLINE:
            return  # paused while the check ran
        old = self.blocks
        new = range(new_start, new_start + self.num_blocks)
        logger.info("moving from blocks %d:%d to %d:%d to strengthen the swarm", old.start, old.stop,
                    new.start, new.stop)
        self.emit(self.status_event("moving", to_blocks=[new.start, new.stop]))
        self.handler.set_span(None)  # sessions on the old span end at their next step; clients re-route
        await self._announce(ServerState.OFFLINE, old)
        self.blocks = new
        try:
            await self._load(new)
        except Exception as exc:
            logger.error("loading blocks %d:%d failed (%s); going back to %d:%d", new.start, new.stop, exc,
                         old.start, old.stop)
            await self._announce(ServerState.OFFLINE, new)
            self.blocks = old
            await self._load(old)  # if even this fails, the loop ends and the server stops

    # ---- stepping aside for the owner (pause.py) ------------------------------------------------------------------
    def command(self, command: dict) -> None:
        """A control command from the owner (serve --control-stdin), on the server's loop: {"command": "pause",
        "seconds": S} or {"command": "resume"} (a pause by hand; the conditions still hold the node paused)."""
        if self.pause_watch is None:
            logger.warning("ignoring %r: this server has no pause watch", command)
            return
        if command.get("command") == "pause":
            self.pause_watch.pause_for(float(command.get("seconds", 3600)))
        elif command.get("command") == "resume":
            self.pause_watch.resume()
        else:
            logger.warning("unknown control command %r", command)
            return
        self._pause_wake.set()

    async def _pause_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                await asyncio.wait_for(self._pause_wake.wait(), self.pause_watch.settings.check_period)
            except asyncio.TimeoutError:
                pass
            self._pause_wake.clear()
            reason = await loop.run_in_executor(None, self.pause_watch.reason)  # may run loginctl
            if reason and self.paused is None and self.state == ServerState.ONLINE:
                await self.pause(reason)
            elif reason is None and self.paused is not None:
                await self.resume()

    async def pause(self, reason: str) -> None:
        """Leave gracefully: OFFLINE in the DHT, no new sessions, open ones end after their current step (their
        clients fail over), then the span and the caches are freed."""
        async with self._span_lock:
            self.paused, self.state = reason, ServerState.OFFLINE
            self.emit(self.status_event("pausing", reason=reason))
            await self._announce(ServerState.OFFLINE, self.blocks)
            served, _ = self.handler.served, self.handler.set_span(None)
            await self._drain(PAUSE_DRAIN_S)
            self._free(served)
            self.emit(self.status_event("paused", reason=reason))

    def _free(self, served) -> None:
        """Give the span's memory back: its weights go to the meta device (a stray reference to the module, such as
        a logged exception's frames, then holds no memory), the allocator's caches are emptied."""
        if served is not None and not self.handler.sessions:
            served.span.to("meta")
            forget_arrays(served.span)  # the numpy/C kernels' views of the old weights
        gc.collect()
        if self.config.device.startswith("cuda"):
            torch.cuda.empty_cache()

    async def _drain(self, seconds: float) -> None:
        """Until the open sessions have ended (each at its next step), at most `seconds`; then end the idle ones."""
        deadline = time.monotonic() + seconds
        while self.handler.sessions and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.handler.end_sessions()
        while self.handler.sessions and time.monotonic() < deadline + 5.0:
            await asyncio.sleep(0.05)

    async def resume(self) -> None:
        """Rejoin after a pause: blocks chosen again (unless fixed), loaded, ONLINE."""
        async with self._span_lock:
            self.paused = None
            self.emit(self.status_event("resuming"))
            if self.config.block_indices is None:
                self.blocks = await self._choose_blocks(exclude_self=True)
            await self._load(self.blocks)

    async def _should_move(self) -> int | None:
        blocks = await self._answering_blocks()
        spans = spans_of(blocks, states=(ServerState.JOINING, ServerState.ONLINE))
        claims = capped_claims(blocks)  # a fake throughput weighs at most 10x the others' median
        placements = {peer: ServerSpan(span.start, span.end, claims.get(peer, span.info.throughput))
                      for peer, span in spans.items()}
        if self.peer_id not in placements:  # our own record may not be visible yet: use what we know
            placements[self.peer_id] = ServerSpan(self.blocks.start, self.blocks.stop, self.throughput())
        me = list(placements).index(self.peer_id)
        return should_move(self.model_config.num_layers, list(placements.values()), me, self.config.balance_quality)

    async def _shutdown(self) -> None:
        self._released.set()
        if self.dht is not None and self.blocks is not None and self.state != ServerState.OFFLINE:
            self.state = ServerState.OFFLINE
            await self._announce(ServerState.OFFLINE, self.blocks, timeout=5.0)
        if self.handler is not None:
            self.handler.set_span(None)
            self.handler.close()
        if self.dht is not None:
            try:
                await asyncio.wait_for(self.dht.shutdown(), 5.0)
            except Exception as exc:
                logger.debug("DHT shutdown: %s", exc)
        if self.p2p is not None:
            await self.p2p.shutdown()
        if self.peer_id is not None:
            self.emit(self.status_event("offline"))


# how long a stopping server waits for its cancelled background loops (announce, balance, stats, pause)
LOOPS_STOP_S = 10.0


def _normalized(value) -> object:
    """A DHT value with lists and tuples alike (msgpack may give back either), for comparing records."""
    if isinstance(value, (list, tuple)):
        return tuple(_normalized(item) for item in value)
    if isinstance(value, dict):
        return {key: _normalized(item) for key, item in value.items()}
    return value


def span_weights(span) -> dict:
    """How a loaded span holds its weights, for the "online" status event: bytes per format (a GGUF's Q8_0/Q4_0/Q4_1
    linears packed at their block bytes, as load_span keeps them on a CPU in fp32; the rest in the span's dtype),
    and the dtype hidden states travel in (the span's: fp32/bf16/fp16, as Petals expects, whatever the weights)."""
    held: dict[str, int] = {}
    for module in span.modules():
        if isinstance(module, QuantizedLinear):
            held[module.fmt.name] = held.get(module.fmt.name, 0) + int(module.packed.nbytes)
    dense = sum(p.numel() * p.element_size() for p in span.parameters())
    held[dtype_name(span.dtype)] = held.get(dtype_name(span.dtype), 0) + int(dense)
    return {"bytes": held, "hidden_dtype": dtype_name(span.dtype)}
