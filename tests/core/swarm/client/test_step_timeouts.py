"""A server's claimed speed cannot move the client's step timeout out of [step_timeout, ceiling] (issue 17 item 3):
a silent server that claims 1e-9 tokens/s is failed over within the ceiling, and the output equals the local blocks.

Real servers of the tiny model in this process: h (honest) and s (claims 1e6 tokens/s for routing and 1e-9 for a
prefill; its steps never answer, while it still answers rpc_info), both blocks 0:2.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from hivekeeper.core.runtime.checkpoint import load_span
from hivekeeper.core.runtime.model import KVCache
from hivekeeper.core.swarm.client.inference import ClientConfig, SwarmClient, _ServerSession
from hivekeeper.core.swarm.client.routing import Hop
from hivekeeper.core.swarm.dht import RemoteSpanInfo, ServerInfo, ServerState

from .servers import InProcessServers

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

PREFIX = "timeouts-test"
CEILING = dict(step_timeout=1.0, max_step_timeout=2.0, slowest_rps=20.0)


@pytest.fixture(scope="module")
def swarm(tiny_checkpoint):
    servers = InProcessServers(tiny_checkpoint, PREFIX)
    try:
        servers.names = {
            "h": servers.start((0, 2), "h"),
            "s": servers.start((0, 2), "s", silent=True,
                               record={"inference_rps": 1e6, "forward_rps": 1e-9, "throughput": 1e6}),
        }
        yield servers
    finally:
        servers.close()


@pytest.fixture(scope="module")
def client(swarm):
    client = SwarmClient(ClientConfig(initial_peers=tuple(swarm.initial_peers), dht_prefix=PREFIX, num_blocks=2,
                                      retry_seconds=20.0, ban_seconds=1.0, **CEILING))
    yield client
    client.close()


def ceiling(tokens: int, blocks: int) -> float:
    return CEILING["max_step_timeout"] + tokens * blocks / CEILING["slowest_rps"]


@pytest.mark.parametrize("claim", [math.nan, math.inf, -1.0, 0.0, 1e-9, 1e12, None])
@pytest.mark.parametrize("tokens", [1, 64])
def test_any_claimed_speed_gives_a_timeout_between_the_floor_and_the_ceiling(client, claim, tokens):
    info = ServerInfo(ServerState.ONLINE, claim if claim is not None else 0.0, inference_rps=claim, forward_rps=claim)
    session = _ServerSession(client, Hop("peer", 0, 2, RemoteSpanInfo("peer", 0, 2, info)), 16)
    timeout = session._timeout(tokens)
    assert CEILING["step_timeout"] <= timeout <= ceiling(tokens, 2)
    assert math.isfinite(session.expected_seconds) and session.expected_seconds >= 0
    if claim == 1e12:
        assert timeout == pytest.approx(CEILING["step_timeout"], abs=1e-3)  # a fast claim cannot go under the floor
    if claim == 1e-9:
        assert timeout == ceiling(tokens, 2)  # nor a slow one past the ceiling


def test_a_silent_server_claiming_1e_minus_9_is_failed_over_within_the_ceiling(swarm, client, tiny_checkpoint):
    h, s = swarm.names["h"], swarm.names["s"]
    span = load_span(tiny_checkpoint, 0, 2)
    cache = KVCache.allocate(span.config, 2, 1, 16)
    client.bans.fail(h)  # for 1 s: the session starts on s, and h is back by the time s has missed its deadline
    torch.manual_seed(0)
    prompt = torch.randn(1, 4, 64)
    with client.inference_session(16) as session:
        started = time.monotonic()
        output = session.step(prompt)
        took = time.monotonic() - started
        with torch.inference_mode():
            assert torch.allclose(output, span(prompt, cache), atol=1e-5)
        (failover,) = session.recoveries
        assert failover["peer_id"] == s and "deadline" in failover["error"]
        assert session.route == [(h, 0, 2)]
    assert ceiling(4, 2) <= took < ceiling(4, 2) + 5.0
