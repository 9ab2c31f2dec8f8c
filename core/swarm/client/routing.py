"""Choosing servers for a chain of blocks, and banning the ones that fail. Pure logic: no network here.

Inference (latency): shortest path over block boundaries; using server s for blocks [a, b) costs
    RTT(client, s) + a small per-hop constant + (b - a) / inference_rps(s) (+ a large penalty without cache room).
Forward (throughput): from each block, the covering span that reaches furthest (ties: higher throughput).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

from hivekeeper.core.swarm.dht import RemoteSpanInfo

HOP_OVERHEAD_S = 0.005  # per server entered: serialization, scheduling
NO_CACHE_PENALTY_S = 1000.0  # a server without room for the session's cache: only if nothing else exists
UNKNOWN_RTT_S = 0.1


@dataclass(frozen=True)
class Hop:
    """One server of a route and the blocks [start, end) it runs."""

    peer_id: str
    start: int
    end: int
    span: RemoteSpanInfo


class NoRoute(RuntimeError):
    """No (unbanned) servers cover some block."""


class BanList:
    """Peers that failed, each banned for base × backoff^(failures - 1) seconds (Petals' base: 15 s)."""

    def __init__(self, base_seconds: float = 15.0, backoff: float = 2.0, max_seconds: float = 600.0):
        self.base, self.backoff, self.max = base_seconds, backoff, max_seconds
        self._failures: dict[str, int] = {}
        self._until: dict[str, float] = {}

    def fail(self, peer_id: str) -> float:
        """Record a failure; returns the ban length in seconds."""
        failures = self._failures.get(peer_id, 0) + 1
        self._failures[peer_id] = failures
        seconds = min(self.max, self.base * self.backoff ** (failures - 1))
        self._until[peer_id] = time.monotonic() + seconds
        return seconds

    def busy(self, peer_id: str, seconds: float = 2.0) -> float:
        """A server that answered "server busy" (protocol.is_busy): skipped for a few seconds so that the next route
        avoids it at once, but not counted as a failure (its next ban does not grow)."""
        self._until[peer_id] = max(self._until.get(peer_id, 0.0), time.monotonic() + seconds)
        return seconds

    def forever(self, peer_id: str) -> None:
        """Ban for the client's lifetime (a server caught returning wrong outputs)."""
        self._failures[peer_id] = self._failures.get(peer_id, 0) + 1
        self._until[peer_id] = math.inf

    def succeed(self, peer_id: str) -> None:
        self._failures.pop(peer_id, None)
        self._until.pop(peer_id, None)

    def banned(self, peer_id: str) -> bool:
        return self._until.get(peer_id, 0.0) > time.monotonic()


def _block_seconds(span: RemoteSpanInfo) -> float:
    rps = span.info.inference_rps or span.info.throughput
    return 1.0 / rps if rps and rps > 0 else 1.0


def route_inference(spans: list[RemoteSpanInfo], start: int, end: int, *, rtts: dict[str, float] | None = None,
                    cache_tokens_needed: int = 0, banned=lambda peer: False) -> list[Hop]:
    """The route of least expected latency through blocks [start, end)."""
    rtts = rtts or {}
    usable = [s for s in spans if not banned(s.peer_id) and s.start < end and s.end > start]
    best = {start: (0.0, None)}  # boundary -> (cost, (previous boundary, hop))
    for position in range(start, end):
        if position not in best:
            continue
        cost_here = best[position][0]
        for span in usable:
            if not span.start <= position < span.end:
                continue
            enter = rtts.get(span.peer_id, UNKNOWN_RTT_S) + HOP_OVERHEAD_S
            cache_left = span.info.cache_tokens_left
            if cache_tokens_needed and cache_left is not None and cache_left < cache_tokens_needed:
                enter += NO_CACHE_PENALTY_S
            per_block = _block_seconds(span)
            for stop in range(position + 1, min(span.end, end) + 1):
                cost = cost_here + enter + (stop - position) * per_block
                if stop not in best or cost < best[stop][0]:
                    best[stop] = (cost, (position, Hop(span.peer_id, position, stop, span)))
    if end not in best:
        reached = max(best)
        raise NoRoute(f"no server covers block {reached} (blocks {start}:{end} needed)")
    hops, position = [], end
    while position != start:
        position, hop = best[position][1]
        hops.append(hop)
    return hops[::-1]


def route_forward(spans: list[RemoteSpanInfo], start: int, end: int, *, banned=lambda peer: False,
                  rng: random.Random | None = None) -> list[Hop]:
    """A route for throughput: at each block take the covering span that reaches furthest."""
    rng = rng or random.Random()
    usable = [s for s in spans if not banned(s.peer_id)]
    hops, position = [], start
    while position < end:
        covering = [s for s in usable if s.start <= position < s.end]
        if not covering:
            raise NoRoute(f"no server covers block {position} (blocks {start}:{end} needed)")
        furthest = max(min(s.end, end) for s in covering)
        candidates = [s for s in covering if min(s.end, end) == furthest]
        weights = [max(s.info.throughput, 1e-9) for s in candidates]
        span = rng.choices(candidates, weights=weights)[0]
        hops.append(Hop(span.peer_id, position, furthest, span))
        position = furthest
    return hops


def uncovered_blocks(spans: list[RemoteSpanInfo], start: int, end: int, *, usable=lambda peer: True) -> list[int]:
    """The blocks of [start, end) that no usable server's span covers."""
    covered = set()
    for span in spans:
        if usable(span.peer_id):
            covered.update(range(max(span.start, start), min(span.end, end)))
    return [block for block in range(start, end) if block not in covered]


def block_ranges(blocks: list[int]) -> str:
    """[2, 3, 5] -> "2:4, 5:6": runs of consecutive blocks as half-open spans (as --block-indices takes them)."""
    runs: list[list[int]] = []
    for block in sorted(set(blocks)):
        if runs and block == runs[-1][1]:
            runs[-1][1] = block + 1
        else:
            runs.append([block, block + 1])
    return ", ".join(f"{a}:{b}" for a, b in runs)


def route_cost(hops: list[Hop], rtts: dict[str, float]) -> float:
    """Expected seconds of one 1-token step along a route (for display and tests)."""
    return sum(rtts.get(h.peer_id, UNKNOWN_RTT_S) + HOP_OVERHEAD_S + (h.end - h.start) * _block_seconds(h.span)
               for h in hops) if hops else math.inf
