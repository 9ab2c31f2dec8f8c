"""Routing rules a mutation run found unchecked (docs/testing.md): the forward route draws among equally long spans
in proportion to their throughput (below 1 too; one claiming none is all but never drawn), names the block nobody
covers, and keeps each hop's span (its dtype and speed are read from it); an inference route weighs throughput (when
no inference speed is known), latency (an unmeasured peer counts as 0.1 s) and cache room (exactly enough is
enough); a peer that answers is cleared even if it never failed."""

from __future__ import annotations

import random

import pytest

from hivekeeper.core.swarm.client.routing import BanList, NoRoute, route_forward, route_inference
from hivekeeper.core.swarm.dht import RemoteSpanInfo, ServerInfo, ServerState


def span(peer: str, start: int, end: int, throughput: float) -> RemoteSpanInfo:
    return RemoteSpanInfo(peer, start, end, ServerInfo(ServerState.ONLINE, throughput, start_block=start,
                                                       end_block=end))


def test_forward_routes_share_equal_spans_by_throughput():
    fast, slow = span("fast", 0, 4, 9.0), span("slow", 0, 4, 1.0)
    rng = random.Random(7)
    routes = [route_forward([fast, slow], 0, 4, rng=rng) for _ in range(2000)]
    share = sum(route[0].peer_id == "fast" for route in routes) / len(routes)
    assert abs(share - 0.9) < 0.03  # 9 : 1, about 4.5 standard deviations
    assert all(route[0].span is (fast if route[0].peer_id == "fast" else slow) for route in routes)


def test_forward_route_names_the_first_block_nobody_covers():
    with pytest.raises(NoRoute, match=r"no server covers block 3 \(blocks 1:6 needed\)"):
        route_forward([span("a", 0, 3, 1.0), span("b", 4, 6, 1.0)], 1, 6)


def test_a_peer_that_answers_is_cleared_whether_or_not_it_failed_before():
    bans = BanList(base_seconds=30.0)
    bans.succeed("never-failed")  # nothing to clear, and no error
    assert not bans.banned("never-failed")
    bans.fail("p")
    bans.succeed("p")
    assert not bans.banned("p") and bans.fail("p") == 30.0  # the backoff starts again from the base


def rps_span(peer: str, start: int, end: int, *, throughput: float, inference_rps=None, cache=10**6):
    info = ServerInfo(ServerState.ONLINE, throughput, start_block=start, end_block=end, inference_rps=inference_rps,
                      cache_tokens_left=cache)
    return RemoteSpanInfo(peer, start, end, info)


def test_inference_routes_weigh_speed_latency_and_cache_room():
    # without an inference speed the advertised throughput sets a block's time
    fast, slow = rps_span("fast", 0, 4, throughput=100.0), rps_span("slow", 0, 4, throughput=1.0)
    assert route_inference([slow, fast], 0, 4, rtts={"fast": 0.01, "slow": 0.01})[0].peer_id == "fast"
    # a peer never measured counts as 0.1 s away: better than one measured at 0.5 s, worse than one at 0.01 s
    a, b = rps_span("measured", 0, 4, throughput=100.0), rps_span("unknown", 0, 4, throughput=100.0)
    assert route_inference([a, b], 0, 4, rtts={"measured": 0.5})[0].peer_id == "unknown"
    assert route_inference([a, b], 0, 4, rtts={"measured": 0.01})[0].peer_id == "measured"
    # room for exactly the tokens needed is room enough
    exact = rps_span("exact", 0, 4, throughput=100.0, cache=64)
    roomy = rps_span("roomy", 0, 4, throughput=50.0, cache=10**6)
    rtts = {"exact": 0.01, "roomy": 0.01}
    assert route_inference([roomy, exact], 0, 4, rtts=rtts, cache_tokens_needed=64)[0].peer_id == "exact"
    assert route_inference([roomy, exact], 0, 4, rtts=rtts, cache_tokens_needed=65)[0].peer_id == "roomy"


def test_forward_routes_share_by_throughput_below_one_too_and_servers_claiming_none_still_route():
    slow, slower, idle = span("slow", 0, 4, 0.9), span("slower", 0, 4, 0.1), span("idle", 0, 4, 0.0)
    rng = random.Random(8)
    routes = [route_forward([slow, slower, idle], 0, 4, rng=rng)[0].peer_id for _ in range(2000)]
    assert abs(routes.count("slow") / len(routes) - 0.9) < 0.03 and "idle" not in routes
    assert route_forward([idle, span("idle too", 0, 4, 0.0)], 0, 4, rng=rng)[0].peer_id in ("idle", "idle too")
