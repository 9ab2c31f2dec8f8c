"""Failover right after a rewind or a beam reorder: the replacement server must get the history the session holds
now, not the one it was sent.

Three servers of the tiny model's blocks [0, 2) run in this process (SwarmServer on a background loop, each with
its own p2pd on 127.0.0.1); a SwarmClient session steps through one of them. After `truncate` (start_from_position)
or `reorder` (hypo_ids) the server in use leaves, and the next step is recovered on another one by replaying the
history: cut at the rewind point, rows in the new beam order. A second swarm of two servers, one block each, checks
that a rewind and a reorder reach every server of a chain when nothing fails. Every output is checked against the
same blocks run here with a local KV cache that was rewound or reordered the same way.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from hivekeeper.core.runtime.model import KVCache
from hivekeeper.core.swarm.client.inference import ClientConfig, SwarmClient
from hivekeeper.core.swarm.protocol import new_event_loop
from hivekeeper.core.swarm.server.server import ServerConfig, SwarmServer
from hivekeeper.planner.errors import InputError

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

PREFIX = "recovery-test"
MAX_LENGTH = 16


class LocalServers:
    """SwarmServers of the tiny model's blocks on one background loop, in a swarm of their own (`prefix`);
    `leave(peer)` stops one (it announces OFFLINE and its p2pd exits, which breaks the client's open stream)."""

    def __init__(self, checkpoint, prefix: str = PREFIX):
        self.checkpoint, self.prefix = checkpoint, prefix
        self.loop = new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-servers", daemon=True)
        self.thread.start()
        self.running: dict[str, tuple[SwarmServer, object]] = {}

    @property
    def initial_peers(self) -> list[str]:
        """The addresses of the servers still running."""
        return [server.maddrs[0] for server, _ in self.running.values()]

    def start(self, blocks: tuple[int, int] = (0, 2)) -> None:
        online = threading.Event()
        config = ServerConfig(checkpoint=self.checkpoint, dht_prefix=self.prefix,
                              initial_peers=tuple(self.initial_peers), host="127.0.0.1", block_indices=blocks,
                              throughput=1.0, update_period=30.0, public_name=f"server-{blocks[0]}-{blocks[1]}")
        server = SwarmServer(config, status=lambda event: event["state"] == "online" and online.set())
        future = asyncio.run_coroutine_threadsafe(server.run(), self.loop)
        if not online.wait(60):
            future.cancel()
            raise AssertionError(f"server did not come online: {future.exception() if future.done() else 'hung'}")
        self.running[server.peer_id] = (server, future)

    def leave(self, peer_id: str) -> None:
        server, future = self.running.pop(peer_id)
        self.loop.call_soon_threadsafe(server.stop)
        future.result(timeout=30)

    def close(self) -> None:
        for peer_id in list(self.running):
            self.leave(peer_id)

        async def cancel_the_rest() -> None:  # hivemind leaves DHT refresh tasks behind
            others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_the_rest(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(scope="module")
def servers(tiny_checkpoint):
    local = LocalServers(tiny_checkpoint)
    try:
        for _ in range(3):  # each test makes one leave; the last one is spare
            local.start()
        yield local
    finally:
        local.close()


@pytest.fixture
def client(servers):
    client = SwarmClient(ClientConfig(initial_peers=tuple(servers.initial_peers), dht_prefix=PREFIX, num_blocks=2,
                                      retry_seconds=30.0))
    yield client
    client.close()


@pytest.fixture(scope="module")
def chain(tiny_checkpoint):
    """Servers of one block each, in a swarm of their own: every step crosses two (the first block has a spare)."""
    local = LocalServers(tiny_checkpoint, prefix="chain-test")
    try:
        local.start((0, 1))
        local.start((1, 2))
        local.start((0, 1))  # a spare for the first block (the last test makes one leave)
        yield local
    finally:
        local.close()


def check_step(session, cache, span, chunk: torch.Tensor, what: str) -> None:
    with torch.inference_mode():
        expected = span(chunk, cache)
    assert torch.allclose(session.step(chunk), expected, atol=1e-5), what
    assert session.length == cache.length


def check_record(record: dict, peer_id: str, blocks: tuple[int, int]) -> None:
    """What a session reports of a recovery: the server, its blocks, when, how long, why."""
    assert record["peer_id"] == peer_id and record["blocks"] == list(blocks)
    assert record["public_name"] == f"server-{blocks[0]}-{blocks[1]}"
    assert abs(record["time"] - time.time()) < 120 and 0 <= record["seconds"] < 30
    assert isinstance(record["error"], str) and record["error"]


def the_server_in_use(session) -> str:
    (peer_id, start, end), = session.route
    assert (start, end) == (0, 2)
    return peer_id


def test_failover_after_a_rewind_replays_only_the_tokens_kept(servers, client, span):
    torch.manual_seed(11)
    chunks = [torch.randn(1, 4, 64), torch.randn(1, 1, 64), torch.randn(1, 1, 64), torch.randn(1, 11, 64)]
    cache = KVCache.allocate(span.config, 2, 1, MAX_LENGTH)
    with client.inference_session(max_length=MAX_LENGTH, batch=1) as session:
        check_step(session, cache, span, chunks[0], "prompt")
        check_step(session, cache, span, chunks[1], "one token")
        with pytest.raises(InputError, match=r"hidden states must be \[1, tokens, hidden\], got \(1, 64\)"):
            session.step(torch.randn(1, 64))  # the batch is right, the token axis missing
        with pytest.raises(InputError, match="cannot rewind the session to 6 tokens: it holds 5"):
            session.truncate(6)
        session.truncate(5)  # to where it is: nothing to forget
        cache.truncate(4)
        session.truncate(4)  # forget the last token: the next step starts at position 4
        failed = the_server_in_use(session)
        servers.leave(failed)
        check_step(session, cache, span, chunks[2], "the step after the rewind, on the replacement")
        assert [r["peer_id"] for r in session.recoveries] == [failed]
        assert session.recoveries[0]["replayed_tokens"] == 4  # positions 0-3, not the forgotten 4th
        assert the_server_in_use(session) != failed and client.bans.banned(failed)
        check_record(session.recoveries[0], failed, (0, 2))
        assert client.failovers == session.recoveries  # the client's list (the app's Swarm page) has the same record
        # the session counts from the rewind: 5 + 11 tokens fill max_length exactly, one more does not fit
        check_step(session, cache, span, chunks[3], "up to max_length, on the replacement")
        with pytest.raises(InputError, match="17 tokens exceed the session's max_length 16"):
            session.step(torch.randn(1, 1, 64))
        cache.truncate(0)
        session.truncate(0)  # start over
        check_step(session, cache, span, torch.randn(1, 3, 64), "a new prompt after rewinding to 0")


def test_failover_after_a_beam_reorder_replays_the_rows_in_their_new_order(servers, client, span):
    torch.manual_seed(12)
    chunks = [torch.randn(2, 3, 64), torch.randn(2, 1, 64), torch.randn(2, 1, 64), torch.randn(2, 1, 64)]
    cache = KVCache.allocate(span.config, 2, 2, MAX_LENGTH)
    with client.inference_session(max_length=MAX_LENGTH, batch=2) as session:
        check_step(session, cache, span, chunks[0], "prompt")
        check_step(session, cache, span, chunks[1], "one token")
        for order in ([1, 0], [0, 0]):  # two reorders before the next step: they compose to [1, 1]
            cache.reorder(torch.tensor(order))
            session.reorder(torch.tensor(order, dtype=torch.int32))  # any integer type
        failed = the_server_in_use(session)
        servers.leave(failed)
        check_step(session, cache, span, chunks[2], "the step after the reorders, on the replacement")
        check_step(session, cache, span, chunks[3], "the next step, on the replacement")
        assert [r["peer_id"] for r in session.recoveries] == [failed]
        assert session.recoveries[0]["replayed_tokens"] == 4
        # the wire and the servers run float32; the caller gets its own dtype back
        assert session.step(torch.randn(2, 1, 64, dtype=torch.float64)).dtype == torch.float64


def test_a_two_server_chain_rewinds_and_reorders_like_a_local_cache(chain, span):
    """No failure: the rewind (start_from_position) and the beam reorder (hypo_ids) reach both servers of the chain,
    in order, over several steps."""
    torch.manual_seed(13)
    chunks = [torch.randn(2, 3, 64), torch.randn(2, 1, 64), torch.randn(2, 2, 64), torch.randn(2, 1, 64)]
    cache = KVCache.allocate(span.config, 2, 2, MAX_LENGTH)
    client = SwarmClient(ClientConfig(initial_peers=tuple(chain.initial_peers), dht_prefix="chain-test",
                                      num_blocks=2, retry_seconds=30.0))
    try:
        with client.inference_session(max_length=MAX_LENGTH, batch=2) as session:
            check_step(session, cache, span, chunks[0], "prompt")
            assert [(start, end) for _, start, end in session.route] == [(0, 1), (1, 2)]
            check_step(session, cache, span, chunks[1], "one token")
            cache.truncate(3), session.truncate(3)
            check_step(session, cache, span, chunks[2], "after the rewind")
            cache.reorder(torch.tensor([1, 1])), session.reorder(torch.tensor([1, 1]))
            check_step(session, cache, span, chunks[3], "after the reorder")
            assert session.recoveries == []
    finally:
        client.close()


def test_a_two_server_chain_with_server_to_server_push_gives_the_same_outputs(chain, span):
    """use_push: the first server passes each step's output straight to the second (the client still sends it a
    copy); plain steps only, so a rewind in between goes the usual way."""
    torch.manual_seed(14)
    chunks = [torch.randn(1, 3, 64), torch.randn(1, 1, 64), torch.randn(1, 1, 64), torch.randn(1, 1, 64)]
    cache = KVCache.allocate(span.config, 2, 1, MAX_LENGTH)
    client = SwarmClient(ClientConfig(initial_peers=tuple(chain.initial_peers), dht_prefix="chain-test",
                                      num_blocks=2, retry_seconds=30.0, use_push=True))
    try:
        with client.inference_session(max_length=MAX_LENGTH, batch=1) as session:
            for step, chunk in enumerate(chunks[:3]):
                check_step(session, cache, span, chunk, f"pushed step {step}")
            cache.truncate(4), session.truncate(4)
            check_step(session, cache, span, chunks[3], "a rewind between pushed steps")
    finally:
        client.close()


def test_failover_of_the_first_server_of_a_chain_keeps_the_second(chain, span):
    torch.manual_seed(15)
    chunks = [torch.randn(1, 3, 64), torch.randn(1, 1, 64), torch.randn(1, 1, 64)]
    cache = KVCache.allocate(span.config, 2, 1, MAX_LENGTH)
    client = SwarmClient(ClientConfig(initial_peers=tuple(chain.initial_peers), dht_prefix="chain-test",
                                      num_blocks=2, retry_seconds=30.0))
    try:
        with client.inference_session(max_length=MAX_LENGTH, batch=1) as session:
            check_step(session, cache, span, chunks[0], "prompt")
            first, second = session.route
            chain.leave(first[0])
            check_step(session, cache, span, chunks[1], "the step after the first server left")
            check_step(session, cache, span, chunks[2], "the next step")
            assert [hop[1:] for hop in session.route] == [(0, 1), (1, 2)] and session.route[1] == second
            assert session.route[0][0] != first[0]
            check_record(session.recoveries[0], first[0], (0, 1))
            assert session.recoveries[0]["replayed_tokens"] == 3
    finally:
        client.close()
