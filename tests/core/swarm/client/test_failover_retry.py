"""A failover that does not go smoothly (issue 24, the swarm client's survivors): the first replacement fails too, a
session fails on its very first step, no replacement works before the retry deadline, no server is left for the
blocks (a SwarmGap dated from the failed server's last answer); and the ban list's rules for a busy server and a liar.

Real servers of the tiny model's blocks [0, 2) run in this process (InProcessServers, each with its own p2pd on
127.0.0.1): "silent" (its steps never answer; it still answers pings) and "slow", which announce 50 and 10 tokens/s,
so that a client routes to silent first; a test that needs a working first server starts "fast" (1e6 tokens/s) and
makes it leave. The claims differ by 40 ms or more a step (two blocks), more than a loaded loopback's RTT varies, and a
working server's step may take up to ~10 s (max_step_timeout) on a loaded machine; silent's steps time out after
2 s + 10 × its claimed time (3-4 s). Each client pings every server before its first step (a client routes on the
first servers that answer, otherwise) and counts them as fresh for the test's length, so the route follows the
announced speeds only.
Outputs are checked against the same blocks run here with a local KV cache.
"""

from __future__ import annotations

import time

import pytest
import torch

from hivekeeper.core.runtime.model import KVCache
from hivekeeper.core.swarm.client.inference import ClientConfig, SwarmClient, SwarmError, SwarmGap
from hivekeeper.core.swarm.client.routing import BanList

from .servers import InProcessServers

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

PREFIX = "failover-retry-test"
MAX_LENGTH = 16


@pytest.fixture(scope="module")
def swarm(tiny_checkpoint):
    servers = InProcessServers(tiny_checkpoint, PREFIX)
    try:
        servers.names = {"silent": servers.start((0, 2), "silent", silent=True, record={"inference_rps": 50.0}),
                         "slow": servers.start((0, 2), "slow", record={"inference_rps": 10.0})}
        yield servers
    finally:
        servers.close()


def make_client(swarm, retry_seconds: float, **settings) -> SwarmClient:
    """A client that has heard from every server (fresh for the whole test: recovery routes without probing)."""
    client = SwarmClient(ClientConfig(initial_peers=tuple(swarm.initial_peers), dht_prefix=PREFIX, num_blocks=2,
                                      retry_seconds=retry_seconds, step_timeout=2.0, max_step_timeout=10.0,
                                      fresh_seconds=300.0, swarm_cache_seconds=0.0, **settings))
    answered = client.run(client.rtts(list(swarm.running)))
    assert all(rtt is not None for rtt in answered.values()), answered
    return client


def check_step(session, cache, span, chunk: torch.Tensor, what: str) -> None:
    with torch.inference_mode():
        expected = span(chunk, cache)
    assert torch.allclose(session.step(chunk), expected, atol=1e-5), what
    assert session.length == cache.length


def test_a_replacement_that_fails_too_is_banned_and_the_next_one_gets_the_history(swarm, span):
    """fast answers the prompt and leaves; its first replacement (silent, the fastest claim left) never answers the
    replay: it is banned and the session goes on with slow, which gets the whole history."""
    fast = swarm.start((0, 2), "fast", record={"inference_rps": 1e6})
    client = make_client(swarm, retry_seconds=60.0)
    torch.manual_seed(21)
    cache = KVCache.allocate(span.config, 2, 1, MAX_LENGTH)
    try:
        with client.inference_session(max_length=MAX_LENGTH) as session:
            check_step(session, cache, span, torch.randn(1, 4, 64), "prompt")
            assert session.route == [(fast, 0, 2)]
            swarm.leave(fast)
            check_step(session, cache, span, torch.randn(1, 1, 64), "the step after fast left")
            check_step(session, cache, span, torch.randn(1, 1, 64), "the next step")
            assert session.route == [(swarm.names["slow"], 0, 2)]
            (record,) = session.recoveries  # one failover, that of fast, whatever its replacements went through
            assert record["peer_id"] == fast and record["replayed_tokens"] == 4
            assert record["new_route"] == [(swarm.names["slow"], 0, 2)]
            assert client.bans.banned(swarm.names["silent"]) and client.bans.banned(fast)
            assert not client.bans.banned(swarm.names["slow"])
    finally:
        client.close()


def test_a_session_whose_first_step_fails_starts_on_another_server(swarm, span):
    """silent takes the prompt and never answers: nothing to replay, the prompt goes to slow."""
    client = make_client(swarm, retry_seconds=60.0)
    torch.manual_seed(22)
    cache = KVCache.allocate(span.config, 2, 1, MAX_LENGTH)
    try:
        with client.inference_session(max_length=MAX_LENGTH) as session:
            check_step(session, cache, span, torch.randn(1, 3, 64), "prompt")
            check_step(session, cache, span, torch.randn(1, 1, 64), "the next step")
            (record,) = session.recoveries
            assert record["peer_id"] == swarm.names["silent"] and record["replayed_tokens"] == 0
            assert session.route == record["new_route"] == [(swarm.names["slow"], 0, 2)]
            assert client.bans.banned(swarm.names["silent"])
    finally:
        client.close()


def test_a_replacement_that_fails_after_the_retry_deadline_ends_the_step_with_an_error(swarm, span):
    """retry_seconds 0.5: fast leaves, its replacement (silent) runs past the deadline before failing; the step
    fails naming the blocks, instead of trying slow."""
    fast = swarm.start((0, 2), "fast", record={"inference_rps": 1e6})
    client = make_client(swarm, retry_seconds=0.5)
    torch.manual_seed(23)
    cache = KVCache.allocate(span.config, 2, 1, MAX_LENGTH)
    try:
        with client.inference_session(max_length=MAX_LENGTH) as session:
            check_step(session, cache, span, torch.randn(1, 2, 64), "prompt")
            swarm.leave(fast)
            with pytest.raises(SwarmError, match="could not recover blocks 0:2: "):
                session.step(torch.randn(1, 1, 64))
            assert client.bans.banned(swarm.names["silent"]) and not client.bans.banned(swarm.names["slow"])
            assert session.recoveries == []
    finally:
        client.close()


def test_a_gap_left_by_a_failed_server_is_dated_from_its_last_answer_and_names_it(swarm, span):
    """fast serves the session and leaves while the client has banned the others: no server for blocks 0:2 and none
    joining, so after gap_seconds (counted from fast's last answer, not from when the failure was seen) the step
    fails with a SwarmGap that names fast as the server that held them."""
    fast = swarm.start((0, 2), "fast", record={"inference_rps": 1e6})
    client = make_client(swarm, retry_seconds=60.0, gap_seconds=1.0, ban_seconds=600.0)
    torch.manual_seed(24)
    cache = KVCache.allocate(span.config, 2, 1, MAX_LENGTH)
    try:
        with client.inference_session(max_length=MAX_LENGTH) as session:
            before = time.time()
            check_step(session, cache, span, torch.randn(1, 2, 64), "prompt")
            after = time.time()
            for other in ("silent", "slow"):
                client.bans.fail(swarm.names[other])
            swarm.leave(fast)
            with pytest.raises(SwarmGap) as gap:
                session.step(torch.randn(1, 1, 64))
            assert gap.value.blocks == [0, 1] and before <= gap.value.since <= after
            assert f"the server that held them, ...{fast[-8:]} (fast), failed: " in str(gap.value)
        # a later session (a chat's /retry) dates the same gap from then, not from its own first look
        with client.inference_session(max_length=MAX_LENGTH) as again:
            with pytest.raises(SwarmGap) as later:
                again.step(torch.randn(1, 2, 64))
        assert later.value.blocks == [0, 1] and later.value.since == gap.value.since
    finally:
        client.close()


# ---- the ban list's rules behind a failover (plain BanList: no servers) ----------------------------------------------
def test_a_busy_server_is_skipped_for_a_while_without_counting_as_a_failure():
    bans = BanList(base_seconds=30.0, backoff=2.0)
    assert bans.busy("default") == 2.0 and not bans.banned("never-busy")
    assert bans.busy("p", 60.0) == 60.0 and bans.banned("p")
    assert bans.fail("p") == 30.0  # its first failure: the busy answer was not one
    bans.fail("q")  # banned for 30 s: a shorter busy skip does not end that ban early
    bans.busy("q", 0.001)
    time.sleep(0.01)
    assert bans.banned("q")
    short = BanList(base_seconds=0.001)
    short.fail("r")
    short.busy("r", 60.0)  # a longer busy skip outlasts a short ban
    time.sleep(0.01)
    assert short.banned("r")


def test_a_server_caught_lying_stays_banned_and_the_ban_counts_as_a_failure():
    bans = BanList(base_seconds=0.001, backoff=3.0)
    bans.forever("p")
    bans.fail("q")
    bans.forever("q")
    time.sleep(0.01)
    assert bans.banned("p") and bans.banned("q")
    assert bans.fail("p") == pytest.approx(0.003)  # its second failure
    assert bans.fail("q") == pytest.approx(0.009)  # its third
