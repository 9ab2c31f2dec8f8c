"""The swarm's state in the DHT: which server serves which blocks, in what state, how fast.

Each block has a key `"{dht_prefix}.{index}"`; every server serving it stores, under subkey = its peer id (base58),
the value `(state, throughput, extra)` with an expiration time, and re-declares it periodically (the Petals
schema; see docs/swarm.md). Readers ignore fields they do not know and entries they cannot parse.

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

    def to_tuple(self) -> tuple[int, float, dict]:
        known = {f.name: getattr(self, f.name) for f in fields(self) if f.name in _EXTRA_TYPES}
        extra = {**self.extra, **{name: value for name, value in known.items() if value is not None}}
        extra["adapters"] = tuple(self.adapters)
        return int(self.state), float(self.throughput), extra

    @classmethod
    def from_tuple(cls, value: Any) -> "ServerInfo":
        """Parse a DHT value; raises ValueError when it is not a (state, throughput, extra) triple."""
        if not isinstance(value, (tuple, list)) or len(value) < 2:
            raise ValueError(f"not a server info tuple: {value!r}")
        state, throughput = value[0], value[1]
        extra = value[2] if len(value) > 2 and isinstance(value[2], dict) else {}
        if isinstance(throughput, bool) or not isinstance(throughput, (int, float)) or not math.isfinite(throughput):
            raise ValueError(f"bad throughput {throughput!r}")
        info = cls(state=ServerState(state), throughput=max(0.0, float(throughput)))
        for name, value in extra.items():
            types = _EXTRA_TYPES.get(name)
            if types is None:
                info.extra[name] = value
            elif isinstance(value, types) and not (isinstance(value, bool) and bool not in types):
                setattr(info, name, tuple(value) if name == "adapters" else value)
        return info


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


async def read_blocks(node: DHTNode, dht_prefix: str, num_blocks: int, latest: bool = True) -> list[dict[str, ServerInfo]]:
    """For each block, {peer_id: ServerInfo} of the servers that declared it (expired and malformed ones dropped)."""
    uids = [block_uid(dht_prefix, i) for i in range(num_blocks)]
    found = await node.get_many(uids, sufficient_expiration_time=math.inf if latest else None)
    now = get_dht_time()
    blocks: list[dict[str, ServerInfo]] = []
    for uid in uids:
        servers: dict[str, ServerInfo] = {}
        entry = found.get(uid)
        if entry is not None and isinstance(entry.value, dict):
            for peer_id, item in entry.value.items():
                if not isinstance(peer_id, str) or item.expiration_time < now:
                    continue
                try:
                    servers[peer_id] = ServerInfo.from_tuple(item.value)
                except (ValueError, TypeError):
                    continue  # a malformed or unknown record: ignore it
        blocks.append(servers)
    return blocks


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
    """Per-block swarm throughput: the sum over JOINING and ONLINE servers covering the block."""
    live = (ServerState.JOINING, ServerState.ONLINE)
    return [sum(info.throughput for info in servers.values() if info.state in live) for servers in blocks]


def live_peers(blocks: list[dict[str, ServerInfo]]) -> list[str]:
    """Peers that declare some block JOINING or ONLINE (sorted)."""
    live = (ServerState.JOINING, ServerState.ONLINE)
    return sorted({peer for servers in blocks for peer, info in servers.items() if info.state in live})


def without_peers(blocks: list[dict[str, ServerInfo]], peers) -> list[dict[str, ServerInfo]]:
    """The records with those peers' entries left out (e.g. the servers that did not answer a probe)."""
    gone = set(peers)
    return [{peer: info for peer, info in servers.items() if peer not in gone} for servers in blocks]


async def ping(p2p: P2P, peer_id: str, timeout: float = PROBE_TIMEOUT_S) -> tuple[float, dict]:
    """(round-trip seconds, the server's rpc_info answer) of one server; raises if it does not answer in time."""
    started = time.perf_counter()
    response = await asyncio.wait_for(p2p.call_protobuf_handler(
        PeerID.from_base58(peer_id), handler_name("rpc_info"), runtime_pb2.ExpertUID(), runtime_pb2.ExpertInfo),
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
