"""Spot checks (issue 17 item 9): a server that returns well-formed but wrong hidden states is caught, banned and
replaced, and the tokens equal an honest run.

Real servers of the tiny model in this process: h and h2 (honest), and per test a liar of its own
(HIVEKEEPER_TEST_LIAR: 0.5 is added to its outputs after its first `liar_after` runs; it claims to be fast and the
others slow, so routes prefer it). All serve 0:2. Each test waits until its client's view of the swarm holds the
liar and has heard from it: a route is taken as soon as the servers that answered cover the blocks, so under load
a slow first answer from the liar left it out, and a route that never meets the liar proves nothing.
"""

from __future__ import annotations

import time

import pytest
import torch

from hivekeeper.core.runtime.checkpoint import load_span
from hivekeeper.core.runtime.model import KVCache
from hivekeeper.core.swarm.client.inference import ClientConfig, SwarmClient, SwarmModel
from hivekeeper.core.swarm.client.spot_check import SpotCheckConfig, first_mismatch, tolerance

from .servers import InProcessServers

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

PREFIX = "spot-check-test"
HONEST_RUNS = 5  # the liar's prefill and 4 decode steps are right


@pytest.fixture(scope="module")
def swarm(tiny_checkpoint):
    servers = InProcessServers(tiny_checkpoint, PREFIX)
    try:
        servers.names = {name: servers.start((0, 2), name, record={"inference_rps": 1.0}) for name in ("h", "h2")}
        yield servers
    finally:
        servers.close()


@pytest.fixture
def start_liar(swarm):
    """start_liar(name, honest_runs) -> its peer id; it leaves the swarm at the end of the test."""
    started = []

    def start(name: str, honest_runs: int) -> str:
        started.append(swarm.start((0, 2), name, liar=0.5, liar_after=honest_runs,
                                   record={"inference_rps": 1e6, "throughput": 1e6}))
        return started[-1]

    yield start
    for peer_id in started:
        swarm.leave(peer_id)


def wait_until_seen(client: SwarmClient, peers: set[str], seconds: float = 30.0) -> None:
    """Until the client's view of the swarm (read afresh) lists all these servers, and each has answered a ping: a
    route is taken as soon as the servers that answered cover the blocks, so one still unheard would be left out."""
    deadline = time.monotonic() + seconds
    while not peers <= {span.peer_id for span in client.run(client.spans(refresh=True))}:
        if time.monotonic() > deadline:
            raise AssertionError(f"the client did not see {sorted(peers)} within {seconds:g}s")
        time.sleep(0.2)
    rtts = client.run(client.rtts(sorted(peers)))
    assert all(rtt is not None for rtt in rtts.values()), f"servers did not answer a ping: {rtts}"


def test_tolerance_and_first_mismatch():
    assert tolerance("float32") == (1e-4, 1e-3) and tolerance("float32", "bfloat16") == (1e-2, 4e-2)
    assert tolerance("mystery") == tolerance("bfloat16")
    reference = torch.ones(1, 6, 8)
    outputs = reference.clone()
    outputs[0, 4, 3] += 0.01  # within bfloat16's tolerance, not within float32's
    outputs[0, 5, 0] = float("nan")
    assert first_mismatch(outputs, reference, *tolerance("float32"))[0] == 4
    assert first_mismatch(outputs, reference, *tolerance("bfloat16"))[0] == 5
    assert first_mismatch(reference, reference, *tolerance("float32")) == (None, 0.0)
    assert [step for step in range(10) if SpotCheckConfig(rate=0.25).due(step)] == [0, 4, 8]
    assert not any(SpotCheckConfig(rate=0.0).due(step) for step in range(10))


def test_a_liar_is_caught_within_four_steps_and_the_tokens_equal_an_honest_run(swarm, start_liar, tiny_checkpoint):
    liar = start_liar("l", HONEST_RUNS)
    prompt = torch.tensor([[1, 5, 9, 13, 17]])
    with SwarmModel(str(tiny_checkpoint), initial_peers=swarm.initial_peers, dht_prefix=PREFIX,
                    spot_check_rate=0.25, retry_seconds=20.0) as model:
        wait_until_seen(model.client, {liar, *swarm.names.values()})
        tokens = model.generate(prompt, 12)
        (failover,) = model.client.failovers
        assert failover["peer_id"] == liar and model.client.bans.banned(liar)
        check = failover["spot_check"]
        length = prompt.shape[1]
        # its first wrong output is the 5th decode step's (position length + 4); the check after step 8 finds it
        assert check["first_wrong_position"] == length + HONEST_RUNS - 1
        assert check["checked_positions"] == [length + 4, length + 8] and check["referee"] == "local"
        assert check["max_diff"] > 0.1 and check["ok"] is False
        assert [c["ok"] for c in model.client.spot_check_log] == [True, True, False, True]
        honest = model.generate(prompt, 12)  # the liar is banned for good: all on honest servers
    assert torch.equal(tokens, honest)


def test_remote_referees_outvote_the_liar_when_the_client_has_no_weights(swarm, start_liar, tiny_checkpoint):
    """Without local weights other servers recompute the blocks: one, and a second when the first disagrees. The
    liar (lying from its first run) is banned whether it was checked or was the referee; the honest servers are not,
    and the step's output is right."""
    liar, honest = start_liar("l0", 0), (swarm.names["h"], swarm.names["h2"])
    span = load_span(tiny_checkpoint, 0, 2)
    client = SwarmClient(ClientConfig(initial_peers=tuple(swarm.initial_peers), dht_prefix=PREFIX, num_blocks=2,
                                      retry_seconds=20.0))
    try:
        wait_until_seen(client, {liar, *honest})
        torch.manual_seed(0)
        prompt = torch.randn(1, 4, 64)
        with client.inference_session(16) as session:
            output = session.step(prompt)
            assert liar not in {peer for peer, _, _ in session.route}
        with torch.inference_mode():
            assert torch.allclose(output, span(prompt, None), atol=1e-4)
        assert client.bans.banned(liar) and not any(client.bans.banned(peer) for peer in honest)
        disputed = [c for c in client.spot_check_log if c.get("second_referee")]
        assert len(disputed) == 1 and liar in (disputed[0]["peer_id"], disputed[0]["referee"])

        # honest servers from here on: the referee keeps its session, and each check sends only the new positions
        client.spot_check_log.clear()
        cache = KVCache.allocate(span.config, 2, 1, 16)
        with client.inference_session(16) as session:
            for chunk in (prompt, *torch.randn(8, 1, 1, 64)):
                output = session.step(chunk)
                with torch.inference_mode():
                    assert torch.allclose(output, span(chunk, cache), atol=1e-4)
        assert [(c["checked_positions"], c["ok"]) for c in client.spot_check_log] == [([0, 4], True), ([4, 12], True)]
        assert {c["referee"] for c in client.spot_check_log} <= set(honest)
    finally:
        client.close()
