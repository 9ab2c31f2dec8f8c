"""The models a swarm serves, and where this machine would help most: what the app's Swarm page lists.

Servers list each public model in the swarm's registry (`_petals.models`, subkey = the model's DHT prefix, value
{"num_blocks": N, "repository": hub id}; core/swarm/dht.py `register_model`, as Petals' servers do). For each
model, `read_directory` reads its blocks' records and sums them up as a row: servers, blocks covered, the weakest
span (the run of blocks around the bottleneck with the same, lowest throughput).

`where_to_help` (with `HelpPlanner`, which sizes each model once) adds what this machine could do for a model (the
planner's server sizing as `hivekeeper serve` plans it, a GGUF's span packed on a CPU: how many blocks it could
hold and the requests/s it would advertise: from `serve`'s own timing of such a block here where it has one,
core/swarm/server/throughput.measured_block_speed, as the app's Swarm page says it, else the planner's estimate),
the span where it adds the most (the window whose weakest blocks are weakest: planner.swarm.choose_start, as a
server picks its blocks), and `best_row` picks the model to join with one click: the one whose gaps it fills, else
the one whose bottleneck it raises the most, relatively. A model whose every block this machine's own servers
already serve (`peers_here`: the servers reached at an address of this machine) gets no help and is never picked.

Registry values are written by anyone: a value that is not such an object, a block count out of 1..MAX_BLOCKS, or
a repository that is not a short string drops that entry only; at most MAX_MODELS models are read.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
from dataclasses import dataclass

from hivemind.dht.node import DHTNode

from hivekeeper.core.swarm.dht import (DHT_READ_TIMEOUT_S, MODELS_REGISTRY_KEY, ServerState, block_throughputs,
                                       read_blocks, spans_of)
from hivekeeper.planner.errors import InputError

MAX_MODELS = 64  # rows read from the registry (a hostile flood of entries costs no more than this)
MAX_BLOCKS = 1024  # no transformer we know has more blocks
MAX_REPOSITORY_CHARS = 200


@dataclass(frozen=True)
class RegistryEntry:
    dht_prefix: str
    repository: str
    num_blocks: int


def parse_registry(value) -> list[RegistryEntry]:
    """The entries of a `_petals.models` DHT value ({subkey: ValueWithExpiration}), each bad one dropped."""
    items = getattr(value, "value", None)
    if not isinstance(items, dict):
        return []
    entries = []
    for prefix, item in items.items():
        doc = getattr(item, "value", None)
        if not isinstance(prefix, str) or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}", prefix) \
                or not isinstance(doc, dict):
            continue
        blocks, repository = doc.get("num_blocks"), doc.get("repository")
        if isinstance(blocks, bool) or not isinstance(blocks, int) or not 1 <= blocks <= MAX_BLOCKS:
            continue
        if not isinstance(repository, str) or not 0 < len(repository) <= MAX_REPOSITORY_CHARS:
            continue
        entries.append(RegistryEntry(prefix, repository, blocks))
    return sorted(entries, key=lambda e: e.dht_prefix)[:MAX_MODELS]


def weakest_span(throughputs: list[float]) -> dict | None:
    """{"start", "end", "throughput"}: the run of blocks around the first bottleneck with its throughput."""
    if not throughputs:
        return None
    low = min(throughputs)
    start = throughputs.index(low)
    end = start
    while end < len(throughputs) and throughputs[end] == low:
        end += 1
    return {"start": start, "end": end, "throughput": low}


def model_row(entry: RegistryEntry, blocks: list[dict]) -> dict:
    """One model's row from its blocks' records."""
    throughputs = block_throughputs(blocks)
    live = (ServerState.JOINING, ServerState.ONLINE)
    covered = sum(any(info.state in live for info in servers.values()) for servers in blocks)
    return {
        "dht_prefix": entry.dht_prefix, "repository": entry.repository, "num_blocks": entry.num_blocks,
        "servers": len(spans_of(blocks, states=live)), "covered_blocks": covered,
        "gaps": [i for i, servers in enumerate(blocks) if not any(info.state in live for info in servers.values())],
        "throughputs": throughputs, "weakest": weakest_span(throughputs),
        "spans": {peer: [span.start, span.end] for peer, span in spans_of(blocks, states=live).items()},
    }


def serves_every_block(row: dict, peers) -> bool:
    """Whether the servers `peers` together serve every block of the row's model (its live spans)."""
    served = set()
    for peer, (start, end) in (row.get("spans") or {}).items():
        if peer in peers:
            served.update(range(start, end))
    return served >= set(range(row["num_blocks"]))


async def read_registry(node: DHTNode, timeout: float = DHT_READ_TIMEOUT_S) -> list[RegistryEntry]:
    """The models the swarm's registry lists (`parse_registry`)."""
    return parse_registry(await asyncio.wait_for(node.get(MODELS_REGISTRY_KEY, latest=True), timeout))


async def read_directory(node: DHTNode, timeout: float = DHT_READ_TIMEOUT_S) -> list[dict]:
    """A row per model in the registry (`model_row`), read at once."""
    entries = await read_registry(node, timeout)
    all_blocks = await asyncio.gather(*(read_blocks(node, e.dht_prefix, e.num_blocks, timeout=timeout)
                                        for e in entries))
    return [model_row(entry, blocks) for entry, blocks in zip(entries, all_blocks)]


def where_to_help(row: dict, can_hold: int, rps: float) -> dict:
    """Where a server holding up to `can_hold` blocks at `rps` requests/s adds the most to this model:
    {"blocks": [start, end], "rps": rps, "gain": ...}. gain is the gaps it fills, then the bottleneck's relative
    rise (its throughput after / before, capped), so that a model with a gap beats one merely slow."""
    from hivekeeper.planner.swarm import choose_start

    n = min(can_hold, row["num_blocks"])
    if n < 1:
        return {"blocks": None, "rps": rps, "gain": 0.0}
    throughputs = row["throughputs"]
    start = choose_start(throughputs, n)
    window = throughputs[start:start + n]
    filled = sum(1 for t in window if t <= 0)
    before = min(throughputs)
    after = min(t + rps if start <= i < start + n else t for i, t in enumerate(throughputs))
    rise = min(after / before, 100.0) if before > 0 else (100.0 if after > 0 else 0.0)
    return {"blocks": [start, start + n], "rps": rps, "gain": filled * 1000.0 + rise}


def best_row(rows: list[dict]) -> dict | None:
    """The model to join with one click: the row whose `help` gains the most (rows without one are skipped)."""
    helpful = [row for row in rows if (row.get("help") or {}).get("blocks")]
    return max(helpful, key=lambda row: row["help"]["gain"], default=None)


class HelpPlanner:
    """What this machine could do for each model (the planner's server sizing, as `hivekeeper serve` plans it: a
    GGUF's span packed on a CPU, format_choice.plan_model_server), worked out once per repository, for this
    machine as serve plans it: detected, with its saved profile (core/machine/profiles.detect_or_load_profile).
    The requests/s offered are serve's measured figure where it has timed such a block here, else the planner's."""

    def __init__(self):
        self.hardware = None  # (HardwareSpec, MachineEfficiency or None), detected at the first model sized
        self.plans: dict[str, tuple[str, object] | str] = {}  # repository -> (planner model, ServerPlan) or why not

    def plan(self, repository: str) -> tuple[str, object] | str:
        """(the model as the planner reads it, its ServerPlan here), or why it cannot tell."""
        if repository not in self.plans:
            try:
                self.plans[repository] = self._plan(repository)
            except Exception as exc:  # noqa: BLE001 - an unknown or unreadable model: the row says so
                self.plans[repository] = f"cannot size this model here ({exc})"
        return self.plans[repository]

    def size(self, repository: str) -> tuple[int, float] | str:
        """(blocks this machine could hold, requests/s the planner says it would advertise), or why it cannot tell."""
        planned = self.plan(repository)
        return planned if isinstance(planned, str) else (planned[1].num_blocks, planned[1].throughput)

    def _plan(self, repository: str) -> tuple[str, object]:
        from hivekeeper.core.machine.profiles import detect_or_load_profile
        from hivekeeper.planner.format_choice import plan_model_server

        if self.hardware is None:
            self.hardware = detect_or_load_profile()
        hardware, efficiency = self.hardware
        model = planner_model(repository)
        return model, plan_model_server(model, hardware, efficiency=efficiency)

    def help(self, row: dict, here=frozenset()) -> dict:
        """where_to_help for this machine; `here`: the servers on this machine (a model they serve whole gets none)."""
        from hivekeeper.core.swarm.server.throughput import measured_block_speed, measured_report

        if here and serves_every_block(row, here):
            return {"blocks": None, "rps": None, "gain": 0.0,
                    "reason": f"this machine serves all {row['num_blocks']} blocks already"}
        planned = self.plan(row["repository"])
        if isinstance(planned, str):
            return {"blocks": None, "rps": None, "gain": 0.0, "reason": planned}
        model, server = planned
        speed = measured_block_speed(model, server)
        if speed is None:
            return {**where_to_help(row, server.num_blocks, server.throughput), "source": "planner's estimate"}
        measured = measured_report(speed, min(server.num_blocks, row["num_blocks"]))
        return {**where_to_help(row, server.num_blocks, measured["throughput"]), "source": measured["source"],
                "planner_rps": server.throughput}


def planner_model(repository: str) -> str:
    """A registry's repository as the planner reads it: a catalog id or a checkpoint path as it is, else the
    checkpoint it resolves to (the default model's installed GGUF, or a hub id's config only: no weights)."""
    from hivekeeper.core.runtime.checkpoint import resolve_checkpoint
    from hivekeeper.planner.model_catalog import load_model_spec

    try:
        load_model_spec(repository)
        return repository
    except InputError:
        return str(resolve_checkpoint(repository, blocks=(0, 0), embeddings=False))


def directory_report(rows: list[dict], planner: HelpPlanner, here=frozenset()) -> dict:
    """{"models": rows with "help" added, "best": the prefix to join with one click or None}; `here`: the servers
    on this machine (`peers_here`)."""
    for row in rows:
        row["help"] = planner.help(row, here)
    best = best_row(rows)
    return {"models": rows, "best": best["dht_prefix"] if best else None}


def live_peers_of(rows: list[dict]) -> set[str]:
    """Every server of every model's row (their live spans)."""
    return {peer for row in rows for peer in row.get("spans") or {}}


async def peers_here(client, peers) -> set[str]:
    """The servers among `peers` that run on this machine: each is pinged (core/swarm/client SwarmClient.rtts), so
    the client holds a connection to it, and those whose connection's far end is an address of this machine (its
    loopback or one of its interfaces') are here."""
    if not peers:
        return set()
    await client.rtts(sorted(peers))
    mine = machine_addresses()
    return {str(info.peer_id) for info in await client.p2p.list_peers()
            if str(info.peer_id) in peers and any(on_this_machine(maddr, mine) for maddr in info.addrs)}


def machine_addresses() -> set:
    """This machine's IP addresses: its interfaces' (loopback included)."""
    import psutil

    found = set()
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            try:
                found.add(ipaddress.ip_address(address.address.split("%")[0]))
            except ValueError:  # a link-layer (MAC) address
                continue
    return found


def on_this_machine(maddr, mine: set) -> bool:
    """Whether a multiaddr's IP is this machine's (`mine`: machine_addresses) or a loopback one."""
    ip = address_of(maddr)
    return ip is not None and (ip.is_loopback or ip in mine)


def address_of(maddr) -> object:
    """The IP address of a multiaddr (/ip4/A/tcp/P, /ip6/A/...), or None (a relay circuit, a DNS name)."""
    parts = str(maddr).split("/")
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return None
    try:
        return ipaddress.ip_address(parts[2])
    except ValueError:
        return None
