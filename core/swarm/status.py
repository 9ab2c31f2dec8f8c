"""The status report of a swarm: per block, the servers covering it and its throughput; per server, its state, span
and speed; the gaps and the bottleneck. `hivekeeper swarm status` prints it, the app's coverage chart draws it
(gui/services/swarm_watch.py): one report, read the same way (`read_swarm_status`), so the two never disagree.
Where no server is found under the prefix, `other_models` names the models the swarm's registry lists instead.
"""

from __future__ import annotations

from dataclasses import asdict

from hivekeeper.core.swarm.directory import read_registry
from hivekeeper.core.swarm.dht import (ServerState, block_throughputs, capped_claims, live_peers, spans_of,
                                       with_confirmed, without_peers)


async def read_swarm_status(client, dht_prefix: str) -> dict:
    """The report as a client (core/swarm/client) reads the swarm now: servers listed OFFLINE are asked whether they
    serve their blocks (anyone can write OFFLINE under a server's key), then every live one is pinged; those that
    left and do not answer for their blocks are not asked."""
    view = await client.view(refresh=True)
    blocks = with_confirmed(view.blocks, view.spans)
    peers = live_peers(blocks)
    rtts = await client.rtts(peers) if peers else {}
    return swarm_status(blocks, dht_prefix, rtts)


async def other_models(node, dht_prefix: str) -> list[dict]:
    """The models the swarm's registry lists under other prefixes (core/swarm/directory.py read_registry), as
    {"dht_prefix", "repository", "num_blocks"}: where none serves `dht_prefix`, one of them may be the same model
    served under another name (`serve --model NAME` derives the prefix from NAME)."""
    return [asdict(entry) for entry in await read_registry(node) if entry.dht_prefix != dht_prefix]


def swarm_status(blocks: list[dict], dht_prefix: str, rtts: dict[str, float | None] | None = None) -> dict:
    """The status report from per-block DHT records ({peer: ServerInfo} per block) and a probe of the servers
    (rtts: {peer: round-trip seconds, or None when it did not answer}; a peer left out was not probed). A server
    that did not answer is "unreachable": it counts for no block's throughput, servers or gaps. Each server's
    "counted_throughput" is what the blocks' throughput counts of its claim ("throughput"): capped as
    `capped_claims` caps it, 0 for a server that is not counted."""
    rtts = rtts or {}
    live = (ServerState.JOINING, ServerState.ONLINE)
    silent = {peer for peer, rtt in rtts.items() if rtt is None}
    answering = without_peers(blocks, silent)
    throughputs = block_throughputs(answering)
    counted = capped_claims(answering)
    all_states = (ServerState.OFFLINE, ServerState.JOINING, ServerState.ONLINE)
    spans = spans_of(blocks, states=all_states)
    per_block = [{
        "index": i,
        "throughput": throughputs[i],
        "servers": sorted(p for p, info in answering[i].items() if info.state in live),
        "unreachable": sorted(p for p, info in servers.items() if info.state in live and p in silent),
    } for i, servers in enumerate(blocks)]
    bottleneck = min(range(len(blocks)), key=lambda i: throughputs[i]) if blocks else None
    servers = []
    for peer_id, span in sorted(spans.items(), key=lambda item: (item[1].start, item[0])):
        info = span.info
        declared = info.state.name.lower()
        servers.append({
            "peer_id": peer_id, "state": "unreachable" if peer_id in silent and info.state in live else declared,
            "declared_state": declared, "public_name": info.public_name,
            "start": span.start, "end": span.end, "throughput": info.throughput,
            "counted_throughput": counted.get(peer_id, 0.0),
            "inference_rps": info.inference_rps, "forward_rps": info.forward_rps, "network_rps": info.network_rps,
            "cache_tokens_left": info.cache_tokens_left, "torch_dtype": info.torch_dtype,
            "quant_type": info.quant_type, "version": info.version, "rtt": rtts.get(peer_id),
        })
    return {
        "dht_prefix": dht_prefix,
        "num_blocks": len(blocks),
        "blocks": per_block,
        "gaps": [b["index"] for b in per_block if not b["servers"]],
        "bottleneck": None if bottleneck is None else {"block": bottleneck, "throughput": throughputs[bottleneck]},
        "servers": servers,
    }
