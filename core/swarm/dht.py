"""The swarm's state in the DHT: which server serves which blocks, in what state, how fast.

Each block has a key `"{dht_prefix}.{index}"`; every server serving it stores, under subkey = its peer id (base58),
the value `(state, throughput, extra)` with an expiration time, and re-declares it periodically (the Petals
schema; see docs/swarm.md). Readers ignore fields they do not know and entries they cannot parse.

Records are written by anyone (the DHT does not know who owns a subkey), so a reader trusts none of them blindly
(issue 17; docs/swarm.md "Records and verification"):
- every read has a deadline (`DHT_READ_TIMEOUT_S`), and one hostile value drops only its own record: a malformed
  tuple, a throughput that is not a finite number >= 0, fields of the wrong type, oversized extras, an int subkey
  (hivemind's merge would raise TypeError on it: `tolerate_mixed_subkeys`);
- a record expiring further ahead than `MAX_RECORD_AHEAD_S` is read as OFFLINE with `suspect` set: it says where the
  peer is listed, nothing more; a client believes a server's own rpc_info answer over any record (`served_span`);
- throughputs are clamped to `MAX_RPS`, and a record far above the other servers' median counts for at most
  `THROUGHPUT_CAP_FACTOR` times it where blocks are chosen (`block_throughputs`).

A record outlives a server that dies without saying goodbye (kill -9, a crash, a pulled cable) until it expires,
two update periods later: minutes. So whoever acts on the records (a server choosing its blocks, `swarm status`,
the app's coverage chart, a client routing) first asks the servers listed as live whether they answer (`probe`:
an rpc_info round trip with a short timeout) and counts only those that do (`without_peers`).
"""

from __future__ import annotations

import asyncio
import enum
import math
import re
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from hivekeeper.core.swarm.protocol import block_uid, handler_name, unpack_metadata
from hivekeeper.planner.errors import InputError

MODELS_REGISTRY_KEY = "_petals.models"  # public swarms list their models here (subkey = dht_prefix)
PROBE_TIMEOUT_S = 2.0  # a live server answers rpc_info in milliseconds; one that has not after this is gone
DHT_READ_TIMEOUT_S = 10.0  # a DHT lookup on a live swarm takes well under a second; a hostile value can stall it
MAX_RECORD_AHEAD_S = 600.0  # ten default update periods: no honest server announces further ahead (server clamps)
MAX_RPS = 1e7  # requests (tokens) per second per block: above any real device; larger claims are clamped to it
THROUGHPUT_CAP_FACTOR = 10.0  # a record counts for at most this times the other servers' median throughput
MAX_EXTRA_BYTES = 16384  # a record's extras (about 300 bytes from a real server) larger than this drop the record


class ServerState(enum.IntEnum):
    OFFLINE = 0
    JOINING = 1
    ONLINE = 2


# extra fields with their expected Python types (a reader drops a field of the wrong type)
_EXTRA_TYPES: dict[str, tuple[type, ...]] = {
    "start_block": (int,),
    "end_block": (int,),
    "public_name": (str,),
    "version": (str,),
    "network_rps": (int, float),
    "forward_rps": (int, float),
    "inference_rps": (int, float),
    "adapters": (tuple, list),
    "torch_dtype": (str,),
    "quant_type": (str,),
    "using_relay": (bool,),
    "cache_tokens_left": (int,),
    "next_pings": (dict,),
}


@dataclass
class ServerInfo:
    """What a server declares for each of its blocks. `throughput` is its advertised requests/s for the span."""

    state: ServerState
    throughput: float
    start_block: int | None = None
    end_block: int | None = None  # exclusive
    public_name: str | None = None
    version: str | None = None
    network_rps: float | None = None
    forward_rps: float | None = None
    inference_rps: float | None = None
    adapters: tuple[str, ...] = ()
    torch_dtype: str | None = None
    quant_type: str | None = None
    using_relay: bool | None = None
    cache_tokens_left: int | None = None
    next_pings: dict[str, float] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # fields this node does not know, kept as they came
    suspect: str | None = None  # reader's note (never stored): why this record's claims are not believed

    def to_tuple(self) -> tuple[int, float, dict]:
        known = {f.name: getattr(self, f.name) for f in fields(self) if f.name in _EXTRA_TYPES}
        extra = {**self.extra, **{name: value for name, value in known.items() if value is not None}}
        extra["adapters"] = tuple(self.adapters)
        return int(self.state), float(self.throughput), extra

    @classmethod
    def from_tuple(cls, value: Any) -> "ServerInfo":
        """Parse a DHT value; raises ValueError when it is not a (state, throughput, extra) triple, its throughput is
        not a finite number >= 0, or its extras are oversized. A known field of the wrong type or range is dropped."""
        if not isinstance(value, (tuple, list)) or len(value) < 2:
            raise ValueError(f"not a server info tuple: {value!r:.80}")
        state, throughput = value[0], value[1]
        extra = value[2] if len(value) > 2 and isinstance(value[2], dict) else {}
        if _rate(throughput, allow_zero=True) is None:
            raise ValueError(f"bad throughput {throughput!r:.40}")
        if isinstance(state, bool) or not isinstance(state, int):
            raise ValueError(f"bad state {state!r:.40}")
        if _too_big(extra, MAX_EXTRA_BYTES):
            raise ValueError(f"extras over {MAX_EXTRA_BYTES} bytes")
        info = cls(state=ServerState(state), throughput=min(float(throughput), MAX_RPS))
        for name, item in extra.items():
            types = _EXTRA_TYPES.get(name)
            if types is None:
                info.extra[name] = item
            elif isinstance(item, types) and not (isinstance(item, bool) and bool not in types):
                setattr(info, name, _checked_field(name, item))
        return info


def _rate(value: Any, allow_zero: bool = False) -> float | None:
    """A requests/s figure as a float clamped to MAX_RPS, or None if it is not a finite number > 0 (>= 0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    if value < 0 or (value == 0 and not allow_zero):
        return None
    return min(float(value), MAX_RPS)


def _checked_field(name: str, value: Any) -> Any:
    """A known extra field as a reader keeps it, or None (dropped) when its value is out of range."""
    if name in ("network_rps", "forward_rps", "inference_rps"):
        return _rate(value)
    if name in ("start_block", "end_block", "cache_tokens_left"):
        return value if value >= 0 else None
    if name == "adapters":
        return tuple(value) if all(isinstance(a, str) for a in value) else ()
    if name == "next_pings":  # the entries that are (peer, finite RTT >= 0); Petals may list unreachable ones as inf
        good = {k: float(v) for k, v in value.items() if isinstance(k, str) and _rate(v, allow_zero=True) is not None}
        return good or None
    return value


def _too_big(value: Any, budget: int) -> bool:
    """Whether a decoded msgpack value takes more than `budget` bytes (counted roughly, stopping at the budget)."""
    stack, used = [value], 0
    while stack:
        item = stack.pop()
        if isinstance(item, (str, bytes)):
            used += len(item)
        elif isinstance(item, dict):
            used += 8 * len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            used += 8 * len(item)
            stack.extend(item)
        else:
            used += 8
        if used > budget:
            return True
    return False


@dataclass(frozen=True)
class RemoteSpanInfo:
    """One server as a reader sees it: peer id, the blocks [start, end) it declares, and its info."""

    peer_id: str  # base58
    start: int
    end: int
    info: ServerInfo

    @property
    def length(self) -> int:
        return self.end - self.start


def dht_prefix_for(model: str, explicit: str | None = None) -> str:
    """The DHT prefix of a model: `explicit` if given, else Petals' convention for a hub id (the repository name,
    '.' -> '-', plus '-hf'), or the folder name for a local checkpoint (give the same prefix on every node)."""
    if explicit:
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*", explicit) or explicit.endswith("."):
            raise InputError(f"--dht-prefix {explicit!r}: use letters, digits, '_', '-' and '.'")
        return explicit
    path = Path(model).expanduser()
    name = path.resolve().name if path.exists() else model.rstrip("/").split("/")[-1]
    if not name:
        raise InputError(f"cannot derive a DHT prefix from {model!r}; pass --dht-prefix")
    prefix = re.sub(r"[^A-Za-z0-9_\-]", "-", name)
    if not path.exists() and not prefix.endswith("-hf"):
        prefix += "-hf"
    return prefix


def check_initial_peers(maddrs) -> tuple[str, ...]:
    """Validate peer multiaddrs (/ip4/HOST/tcp/PORT/p2p/PEER_ID) before any daemon starts."""
    from hivemind.utils.multiaddr import Multiaddr

    for maddr in maddrs:
        try:
            parsed = Multiaddr(maddr)
            parsed["p2p"]
        except Exception:
            raise InputError(f"--initial-peers {maddr!r} is not a peer multiaddr like "
                             "/ip4/1.2.3.4/tcp/31337/p2p/12D3Koo... (copy it from `hivekeeper serve`)") from None
    return tuple(maddrs)


async def declare_blocks(
    node: DHTNode, dht_prefix: str, blocks: range, peer_id: str, info: ServerInfo, expiration_time: float
) -> bool:
    """Store `info` under each block's key (subkey = peer_id) until expiration_time; True if all stores landed."""
    uids = [block_uid(dht_prefix, i) for i in blocks]
    value = info.to_tuple()
    results = await node.store_many(
        uids, [value] * len(uids), expiration_time, subkeys=[peer_id] * len(uids), num_workers=len(uids) or 1
    )
    return all(results.values())


async def register_model(node: DHTNode, dht_prefix: str, num_blocks: int, repository: str, period: float) -> None:
    """List a public model in the swarm's registry (Petals' `_petals.models`); private prefixes start with '_'."""
    if dht_prefix.startswith("_"):
        return
    value = {"num_blocks": num_blocks, "repository": repository}
    await node.store(MODELS_REGISTRY_KEY, value, get_dht_time() + 2 * period, subkey=dht_prefix)


def tolerate_mixed_subkeys() -> None:
    """Make hivemind's expiration heaps order entries with equal expirations and keys of different types (an int
    subkey beside string ones) instead of raising TypeError: that error killed the lookup's search task, and the
    read never returned. Such a record is then dropped by `read_blocks` like any other malformed one."""
    from hivemind.utils.timed_storage import HeapEntry

    if getattr(HeapEntry, "_hivekeeper_tolerant", False):
        return

    def order(entry) -> tuple:
        return entry.expiration_time, type(entry.key).__name__, repr(entry.key)

    def less(a, b):
        if a.expiration_time != b.expiration_time:
            return a.expiration_time < b.expiration_time
        try:
            return a.key < b.key
        except TypeError:
            return order(a) < order(b)

    HeapEntry.__lt__ = less
    HeapEntry.__gt__ = lambda a, b: less(b, a)
    HeapEntry.__le__ = lambda a, b: not less(b, a)
    HeapEntry.__ge__ = lambda a, b: not less(a, b)
    HeapEntry._hivekeeper_tolerant = True


tolerate_mixed_subkeys()


async def read_blocks(node: DHTNode, dht_prefix: str, num_blocks: int, latest: bool = True,
                      timeout: float = DHT_READ_TIMEOUT_S) -> list[dict[str, ServerInfo]]:
    """For each block, {peer_id: ServerInfo} of the servers that declared it (expired and malformed ones dropped).

    One lookup for all blocks within `timeout`; if it fails, each block is looked up alone (a block whose lookup
    fails too reads as empty), so that a hostile value under one key costs that block only, never the reader."""
    uids = [block_uid(dht_prefix, i) for i in range(num_blocks)]
    sufficient = math.inf if latest else None
    try:
        found = await asyncio.wait_for(node.get_many(uids, sufficient_expiration_time=sufficient), timeout)
    except (asyncio.TimeoutError, Exception) as exc:
        if isinstance(exc, asyncio.CancelledError):
            raise
        found = await _read_one_by_one(node, uids, sufficient, timeout)
    now = get_dht_time()
    return [_servers_of(found.get(uid), now) for uid in uids]


async def _read_one_by_one(node: DHTNode, uids: list[str], sufficient, timeout: float) -> dict:
    async def one(uid: str):
        try:
            return (await asyncio.wait_for(node.get_many([uid], sufficient_expiration_time=sufficient), timeout))[uid]
        except asyncio.CancelledError:
            raise
        except Exception:
            return None

    return dict(zip(uids, await asyncio.gather(*(one(uid) for uid in uids))))


def _servers_of(entry: Any, now: float) -> dict[str, ServerInfo]:
    """{peer_id: ServerInfo} from one block's DHT entry, each hostile subkey or value dropped on its own."""
    servers: dict[str, ServerInfo] = {}
    items = getattr(entry, "value", None)
    if not isinstance(items, dict):
        return servers
    for peer_id, item in items.items():  # every one: a flood of junk ahead of them cannot hide the real ones
        expiration = getattr(item, "expiration_time", None)
        if not isinstance(peer_id, str) or not isinstance(expiration, (int, float)) or not expiration >= now:
            continue
        try:
            info = ServerInfo.from_tuple(item.value)
        except Exception:  # noqa: BLE001 - whatever a hostile value raises, it drops that record only
            continue
        if expiration > now + MAX_RECORD_AHEAD_S:
            info.state = ServerState.OFFLINE  # believed only once the server itself confirms it (served_span)
            info.suspect = f"expires {expiration - now:.3g}s ahead (limit {MAX_RECORD_AHEAD_S:g}s)"
        servers[peer_id] = info
    return servers


async def read_own_records(node: DHTNode, dht_prefix: str, blocks: range, peer_id: str,
                           timeout: float = DHT_READ_TIMEOUT_S) -> dict[int, tuple[Any, float | None]]:
    """{block: (value, expiration)} of what the DHT holds under our own subkey for these blocks (value None and
    expiration None where it holds nothing or the lookup failed), to see whether someone overwrote our record."""
    uids = [block_uid(dht_prefix, i) for i in blocks]
    try:
        found = await asyncio.wait_for(node.get_many(uids, sufficient_expiration_time=math.inf), timeout)
    except asyncio.CancelledError:
        raise
    except Exception:
        found = await _read_one_by_one(node, uids, math.inf, timeout)
    records = {}
    for block, uid in zip(blocks, uids):
        items = getattr(found.get(uid), "value", None)
        item = items.get(peer_id) if isinstance(items, dict) else None
        records[block] = (item.value, item.expiration_time) if item is not None else (None, None)
    return records


def spans_of(blocks: list[dict[str, ServerInfo]], states=(ServerState.ONLINE,)) -> dict[str, RemoteSpanInfo]:
    """Each server's span: the contiguous run of blocks it declared (trimmed to its declared start/end)."""
    seen: dict[str, list[int]] = {}
    infos: dict[str, ServerInfo] = {}
    for index, servers in enumerate(blocks):
        for peer_id, info in servers.items():
            if info.state in states:
                seen.setdefault(peer_id, []).append(index)
                infos[peer_id] = info
    spans = {}
    for peer_id, indices in seen.items():
        start = end = indices[0]
        for index in indices:  # first contiguous run only
            if index != end:
                break
            end = index + 1
        spans[peer_id] = RemoteSpanInfo(peer_id, start, end, infos[peer_id])
    return spans


def block_throughputs(blocks: list[dict[str, ServerInfo]]) -> list[float]:
    """Per-block swarm throughput: the sum over JOINING and ONLINE servers covering the block, each server's claim
    capped as `capped_claims` does (a fake throughput cannot make a block look covered, nor the rest look weak)."""
    live = (ServerState.JOINING, ServerState.ONLINE)
    capped = capped_claims(blocks)
    return [sum(capped[peer] for peer, info in servers.items() if info.state in live) for servers in blocks]


def capped_claims(blocks: list[dict[str, ServerInfo]]) -> dict[str, float]:
    """Each JOINING or ONLINE server's throughput, capped at THROUGHPUT_CAP_FACTOR × the median of the other servers'
    claims (when there are others): what block choice and rebalancing count."""
    live = (ServerState.JOINING, ServerState.ONLINE)
    claims = {peer: info.throughput for servers in blocks for peer, info in servers.items() if info.state in live}
    capped = {}
    for peer, claim in claims.items():
        others = sorted(value for other, value in claims.items() if other != peer)
        if others:
            middle = len(others) // 2
            median = others[middle] if len(others) % 2 else (others[middle - 1] + others[middle]) / 2
            claim = min(claim, THROUGHPUT_CAP_FACTOR * median) if median > 0 else claim
        capped[peer] = claim
    return capped


def live_peers(blocks: list[dict[str, ServerInfo]]) -> list[str]:
    """Peers that declare some block JOINING or ONLINE (sorted)."""
    live = (ServerState.JOINING, ServerState.ONLINE)
    return sorted({peer for servers in blocks for peer, info in servers.items() if info.state in live})


def without_peers(blocks: list[dict[str, ServerInfo]], peers) -> list[dict[str, ServerInfo]]:
    """The records with those peers' entries left out (e.g. the servers that did not answer a probe)."""
    gone = set(peers)
    return [{peer: info for peer, info in servers.items() if peer not in gone} for servers in blocks]


def with_confirmed(blocks: list[dict[str, ServerInfo]], spans: list[RemoteSpanInfo]) -> list[dict[str, ServerInfo]]:
    """The records, with each confirmed span's ONLINE info in place of an OFFLINE record (or none) of its peer on the
    blocks it confirmed: anyone can write OFFLINE under a server's subkey, and a server that answers for its blocks
    is serving them (the client's view asks such servers; `swarm status` shows what the client believes)."""
    believed = [dict(servers) for servers in blocks]
    for span in spans:
        for i in range(span.start, min(span.end, len(believed))):
            record = believed[i].get(span.peer_id)
            if record is None or record.state == ServerState.OFFLINE:
                believed[i][span.peer_id] = span.info
    return believed


async def ping(p2p: P2P, peer_id: str, timeout: float = PROBE_TIMEOUT_S, uid: str = "") -> tuple[float, dict]:
    """(round-trip seconds, the server's rpc_info answer) of one server; raises if it does not answer in time, or
    (with a block `uid`) refuses because it does not serve that block now."""
    started = time.perf_counter()
    response = await asyncio.wait_for(p2p.call_protobuf_handler(
        PeerID.from_base58(peer_id), handler_name("rpc_info"), runtime_pb2.ExpertUID(uid=uid), runtime_pb2.ExpertInfo),
        timeout)
    return time.perf_counter() - started, unpack_metadata(response.serialized_info)


async def probe(p2p: P2P, peers, timeout: float = PROBE_TIMEOUT_S) -> dict[str, float | None]:
    """Ping these servers all at once: {peer: round-trip seconds, or None for one that did not answer in time}."""
    async def one(peer: str) -> float | None:
        try:
            return (await ping(p2p, peer, timeout))[0]
        except Exception:  # no route to it, a closed connection, a timeout: it does not answer
            return None

    peers = list(peers)
    return dict(zip(peers, await asyncio.gather(*(one(peer) for peer in peers))))


async def served_span(p2p: P2P, peer_id: str, dht_prefix: str, listed: list[int],
                      timeout: float = PROBE_TIMEOUT_S) -> tuple[int, int] | None:
    """The blocks [start, end) the server itself says it serves, among the blocks where records list it: rpc_info
    (Petals' per-block uid) on the first and last of them; if either is refused, on each, keeping the longest run
    it confirms. None if it confirms none: it is not serving them (or does not answer)."""
    async def serves(block: int) -> bool:
        try:
            await ping(p2p, peer_id, timeout, uid=block_uid(dht_prefix, block))
            return True
        except Exception:
            return False

    listed = sorted(set(listed))
    if not listed:
        return None
    first, last = listed[0], listed[-1]
    if listed == list(range(first, last + 1)) and all(await asyncio.gather(serves(first), serves(last))):
        return first, last + 1  # a server serves one contiguous span: its two ends confirm the run
    confirmed = [block for block, ok in zip(listed, await asyncio.gather(*(serves(b) for b in listed))) if ok]
    runs: list[list[int]] = []
    for block in confirmed:
        if runs and runs[-1][1] == block:
            runs[-1][1] = block + 1
        else:
            runs.append([block, block + 1])
    return tuple(max(runs, key=lambda run: run[1] - run[0])) if runs else None
