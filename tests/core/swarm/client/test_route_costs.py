"""An inference route's costs, rule by rule (survivors of the swarm_routing mutation run, docs/testing.md): a block's
time from the advertised speed (none, zero or a negative claim counts as 1 s), one-block hops, costs counted from the
route's first block (not from block 0), the latency of servers that all lack cache room, no cache room needed unless
asked, and each hop keeping the span it came from."""

from __future__ import annotations

import pytest

from hivekeeper.core.swarm.client.routing import HOP_OVERHEAD_S, Hop, route_cost, route_inference
from hivekeeper.core.swarm.dht import RemoteSpanInfo, ServerInfo, ServerState


def span(peer: str, start: int, end: int, *, throughput: float = 100.0, inference_rps=None, cache=None):
    return RemoteSpanInfo(peer, start, end, ServerInfo(ServerState.ONLINE, throughput, start_block=start,
                                                       end_block=end, inference_rps=inference_rps,
                                                       cache_tokens_left=cache))


def hops(route: list[Hop]) -> list[tuple[str, int, int]]:
    return [(hop.peer_id, hop.start, hop.end) for hop in route]


@pytest.mark.parametrize("throughput, inference_rps, seconds", [
    (4.0, None, 0.25),  # no inference speed: the throughput
    (4.0, 0.5, 2.0),  # an inference speed below 1 block/s
    (0.0, None, 1.0),  # no speed claimed at all
    (-5.0, None, 1.0),  # a negative claim is no claim
])
def test_a_blocks_time_comes_from_the_advertised_speed(throughput, inference_rps, seconds):
    hop = Hop("p", 2, 6, span("p", 2, 6, throughput=throughput, inference_rps=inference_rps))
    assert route_cost([hop], {"p": 0.0}) == pytest.approx(HOP_OVERHEAD_S + 4 * seconds)


def test_a_route_may_use_a_server_for_a_single_block_and_keeps_its_span():
    spans = [span("a", 0, 3), span("one", 3, 4), span("b", 4, 6)]
    route = route_inference(spans, 0, 6, rtts={"a": 0.01, "one": 0.01, "b": 0.01})
    assert hops(route) == [("a", 0, 3), ("one", 3, 4), ("b", 4, 6)]
    assert [hop.span for hop in route] == spans


def test_costs_count_the_blocks_run_not_their_index():
    # blocks 10:12: the near server is the better choice by 2 blocks of time, whatever the blocks' numbers
    near = span("near", 0, 12, inference_rps=100.0)
    far_fast = span("far", 0, 12, inference_rps=1000.0)
    route = route_inference([far_fast, near], 10, 12, rtts={"near": 0.01, "far": 0.05})
    assert hops(route) == [("near", 10, 12)]


def test_without_cache_room_anywhere_the_nearer_server_still_wins():
    near = span("near", 0, 4, inference_rps=100.0, cache=0)
    far = span("far", 0, 4, inference_rps=200.0, cache=0)
    rtts = {"near": 0.01, "far": 0.5}
    assert hops(route_inference([far, near], 0, 4, rtts=rtts, cache_tokens_needed=10)) == [("near", 0, 4)]


def test_no_cache_room_is_needed_unless_asked():
    full = span("full", 0, 4, inference_rps=1000.0, cache=0)
    roomy = span("roomy", 0, 4, inference_rps=10.0, cache=10**6)
    rtts = {"full": 0.01, "roomy": 0.01}
    assert hops(route_inference([roomy, full], 0, 4, rtts=rtts)) == [("full", 0, 4)]
    assert hops(route_inference([roomy, full], 0, 4, rtts=rtts, cache_tokens_needed=1)) == [("roomy", 0, 4)]
