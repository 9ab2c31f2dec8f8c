"""Swarm logic without servers: ServerInfo records, DHT prefixes, routing, bans, the memory pool, the throughput
cache, and declaring/reading blocks through two real in-process DHT nodes. The balancing rule lives in the planner
(tests/planner/test_swarm.py)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from hivekeeper.core.swarm.dht import (
    RemoteSpanInfo,
    ServerInfo,
    ServerState,
    block_throughputs,
    declare_blocks,
    dht_prefix_for,
    read_blocks,
    spans_of,
)
from hivekeeper.core.swarm.server.memory import AllocationFailed, MemoryPool
from hivekeeper.core.swarm.client.routing import BanList, NoRoute, route_forward, route_inference
from hivekeeper.planner.errors import InputError


# ---- ServerInfo ------------------------------------------------------------------------------------------------------
def test_server_info_round_trip_keeps_known_and_unknown_fields():
    info = ServerInfo(ServerState.ONLINE, 12.5, start_block=2, end_block=5, public_name="bob", version="2.3.0.dev2",
                      inference_rps=300.0, forward_rps=5000.0, torch_dtype="bfloat16", quant_type="nf4",
                      cache_tokens_left=4096, next_pings={"peer": 0.01}, extra={"implementation": "x"})
    state, throughput, extra = info.to_tuple()
    assert (state, throughput) == (2, 12.5) and "network_rps" not in extra  # None fields are left out
    back = ServerInfo.from_tuple((state, throughput, extra))
    assert back == info


def test_server_info_reader_is_lenient_with_fields_strict_with_the_tuple():
    info = ServerInfo.from_tuple((1, 3, {"start_block": "zero", "cache_tokens_left": True, "future_field": [1]}))
    assert info.state == ServerState.JOINING and info.start_block is None and info.cache_tokens_left is None
    assert info.extra == {"future_field": [1]}
    for bad in ((7, 1.0, {}), ("x",), (2, float("nan"), {}), {"state": 2}):
        with pytest.raises((ValueError, TypeError)):
            ServerInfo.from_tuple(bad)


def test_dht_prefix_conventions(tmp_path):
    assert dht_prefix_for("meta-llama/Llama-2-70b-hf") == "Llama-2-70b-hf"
    assert dht_prefix_for("meta-llama/Meta-Llama-3.1-405B-Instruct") == "Meta-Llama-3-1-405B-Instruct-hf"
    folder = tmp_path / "my.model"
    folder.mkdir()
    assert dht_prefix_for(str(folder)) == "my-model"
    assert dht_prefix_for(str(folder), "_private") == "_private"
    with pytest.raises(InputError):
        dht_prefix_for("x", "bad prefix")


def _info(state, throughput, start, end):
    return ServerInfo(state, throughput, start_block=start, end_block=end)


def test_spans_and_block_throughputs_from_block_records():
    blocks = [{"a": _info(ServerState.ONLINE, 2.0, 0, 2), "b": _info(ServerState.JOINING, 1.0, 0, 1)},
              {"a": _info(ServerState.ONLINE, 2.0, 0, 2)},
              {"c": _info(ServerState.OFFLINE, 5.0, 2, 3)}]
    assert block_throughputs(blocks) == [3.0, 2.0, 0.0]
    spans = spans_of(blocks)
    assert set(spans) == {"a"} and (spans["a"].start, spans["a"].end) == (0, 2)
    assert set(spans_of(blocks, states=tuple(ServerState))) == {"a", "b", "c"}


# ---- routing ---------------------------------------------------------------------------------------------------------
def _span(peer, start, end, rps, cache=10**6):
    return RemoteSpanInfo(peer, start, end, ServerInfo(ServerState.ONLINE, rps, start_block=start, end_block=end,
                                                       inference_rps=rps, cache_tokens_left=cache))


def test_inference_route_prefers_fewer_faster_hops():
    spans = [_span("long", 0, 6, 100.0), _span("a", 0, 3, 100.0), _span("b", 3, 6, 100.0)]
    route = route_inference(spans, 0, 6, rtts={"long": 0.01, "a": 0.01, "b": 0.01})
    assert [(h.peer_id, h.start, h.end) for h in route] == [("long", 0, 6)]
    slow = [_span("long", 0, 6, 1.0), _span("a", 0, 3, 100.0), _span("b", 3, 6, 100.0)]
    route = route_inference(slow, 0, 6, rtts={"long": 0.01, "a": 0.01, "b": 0.01})
    assert [(h.peer_id, h.start, h.end) for h in route] == [("a", 0, 3), ("b", 3, 6)]


def test_inference_route_avoids_far_servers_without_cache_and_banned_ones():
    spans = [_span("near", 0, 4, 100.0), _span("far", 0, 4, 100.0), _span("full", 0, 4, 1000.0, cache=10)]
    rtts = {"near": 0.005, "far": 0.3, "full": 0.001}
    assert route_inference(spans, 0, 4, rtts=rtts, cache_tokens_needed=100)[0].peer_id == "near"
    assert route_inference(spans, 0, 4, rtts=rtts, cache_tokens_needed=100,
                           banned=lambda p: p == "near")[0].peer_id == "far"
    # a sub-range can be served by a server whose span is larger
    assert [(h.start, h.end) for h in route_inference(spans, 1, 3, rtts=rtts)] == [(1, 3)]
    with pytest.raises(NoRoute, match="block 4"):
        route_inference(spans, 0, 6, rtts=rtts)


def test_forward_route_takes_the_longest_spans():
    spans = [_span("a", 0, 2, 1.0), _span("b", 0, 5, 1.0), _span("c", 2, 6, 1.0), _span("d", 5, 6, 1.0)]
    for _ in range(10):  # c and d both reach the end from block 5: either may be drawn (weighted by throughput)
        route = [(h.peer_id, h.start, h.end) for h in route_forward(spans, 0, 6)]
        assert route[0] == ("b", 0, 5) and route[1] in (("c", 5, 6), ("d", 5, 6)) and len(route) == 2
    with pytest.raises(NoRoute):
        route_forward(spans, 0, 6, banned=lambda p: p in ("c", "d"))


def test_ban_list_backs_off_exponentially():
    bans = BanList(base_seconds=0.05, backoff=2.0)
    assert bans.fail("p") == pytest.approx(0.05) and bans.banned("p")
    assert bans.fail("p") == pytest.approx(0.1)
    bans.succeed("p")
    assert not bans.banned("p") and bans.fail("p") == pytest.approx(0.05)
    time.sleep(0.06)
    assert not bans.banned("p") and not bans.banned("never-failed")


# ---- memory pool -----------------------------------------------------------------------------------------------------
def test_memory_pool_limit_wait_timeout_and_release():
    async def scenario():
        pool = MemoryPool(100)
        with pytest.raises(AllocationFailed, match="more than this server's whole pool"):
            async with pool.reserve(101, timeout=10):
                pass
        async with pool.reserve(60, timeout=0):
            assert pool.free_bytes == 40
            started = time.monotonic()
            with pytest.raises(AllocationFailed, match="alloc_timeout=0.2s"):
                async with pool.reserve(50, timeout=0.2):
                    pass
            assert time.monotonic() - started >= 0.19 and pool.used_bytes == 60

            async def later():  # waits until the 60 come back
                async with pool.reserve(50, timeout=5):
                    return pool.used_bytes

            waiter = asyncio.create_task(later())
            await asyncio.sleep(0.05)
            assert not waiter.done()
        assert await waiter == 50
        assert pool.used_bytes == 0

        # a cancelled waiter (the client went away) takes nothing with it
        async with pool.reserve(100, timeout=0):
            task = asyncio.create_task(pool.reserve(10, timeout=5).__aenter__())
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert pool.used_bytes == 0 and not pool._waiters

    asyncio.run(scenario())


# ---- throughput cache ------------------------------------------------------------------------------------------------
def test_block_speed_is_measured_once_then_cached(tmp_path, monkeypatch, tiny_checkpoint):
    from hivekeeper.core.runtime.checkpoint import load_config
    from hivekeeper.core.swarm.server.throughput import get_block_speed, network_rps_for, span_throughput

    monkeypatch.setenv("HIVEKEEPER_DATA_DIR", str(tmp_path))  # the cache follows the data folder
    config = load_config(tiny_checkpoint)
    speed, cached = get_block_speed(config, "cpu", torch.float32)
    assert not cached and speed.inference_rps > 0 and speed.forward_rps > 0
    again, cached = get_block_speed(config, "cpu", torch.float32)
    assert cached and again == speed
    assert (tmp_path / "swarm_throughput.json").is_file()
    # Petals' formula: compute over the average blocks a request uses, capped by the network
    assert span_throughput(speed, 3, None) == pytest.approx(speed.forward_rps / 2)
    assert span_throughput(speed, 3, 1.0) == 1.0
    assert network_rps_for(100e6, 64) == pytest.approx(100e6 / (16 * 64))


# ---- DHT records through real DHT nodes ------------------------------------------------------------------------------
def test_declare_and_read_blocks_between_two_dht_nodes():
    from hivemind.dht.node import DHTNode
    from hivemind.utils import get_dht_time

    async def scenario():
        first = await DHTNode.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        maddrs = [str(a) for a in await first.get_visible_maddrs()]
        second = await DHTNode.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], client_mode=True)
        try:
            info = ServerInfo(ServerState.ONLINE, 7.0, start_block=1, end_block=3, cache_tokens_left=100)
            assert await declare_blocks(first, "m", range(1, 3), "peerA", info, get_dht_time() + 30)
            gone = ServerInfo(ServerState.ONLINE, 1.0, start_block=0, end_block=1)
            await declare_blocks(first, "m", range(0, 1), "peerB", gone, get_dht_time() + 0.5)
            await first.store("m.2", ("garbage",), get_dht_time() + 30, subkey="peerC")
            await asyncio.sleep(0.6)  # peerB's record expires
            blocks = await read_blocks(second, "m", 4)
            assert blocks[0] == {} and blocks[3] == {}
            assert set(blocks[1]) == {"peerA"} and set(blocks[2]) == {"peerA"}  # peerC's record is dropped
            assert blocks[1]["peerA"].cache_tokens_left == 100
        finally:
            await second.shutdown()
            await first.shutdown()

    asyncio.run(scenario())


# ---- CLI input errors (no network) -----------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["serve", "--model", "{ckpt}", "--new-swarm", "--block-indices", "1:9"], "outside the model's 2 blocks"),
    (["serve", "--model", "{ckpt}", "--new-swarm", "--block-indices", "two"], "expected A:B"),
    (["serve", "--model", "{ckpt}", "--new-swarm", "--num-blocks", "0"], "--num-blocks must be > 0"),
    (["serve", "--model", "{ckpt}", "--new-swarm", "--num-blocks", "3"], "between 1 and 2"),
    (["serve", "--model", "{ckpt}", "--new-swarm", "--throughput", "fast"], "--throughput 'fast'"),
    (["serve", "--model", "/no/such/folder", "--new-swarm"], "no such checkpoint folder"),
    (["swarm"], "usage: hivekeeper swarm status"),
    (["serve", "--model", "{ckpt}", "--initial-peers", "127.0.0.1:4000"], "is not a peer multiaddr"),
    (["swarm", "status", "--model", "{ckpt}", "--initial-peers", "/ip4/127.0.0.1/tcp/1"], "is not a peer multiaddr"),
])
def test_cli_rejects_bad_input_in_one_line(tiny_checkpoint, capsys, argv, message):
    from hivekeeper.core.cli.main import main

    assert main([arg.replace("{ckpt}", str(tiny_checkpoint)) for arg in argv]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert "Serving" not in captured.out  # refused before a model is planned or loaded


def test_a_server_sessions_input_history_grows_rewinds_and_follows_beams():
    """What a client replays to a replacement server: every input so far, after rewinds and beam reorders."""
    from types import SimpleNamespace

    from hivekeeper.core.swarm.client.inference import _ServerSession

    hop = SimpleNamespace(span=SimpleNamespace(info=SimpleNamespace(torch_dtype="float32")), start=0, end=2,
                          peer_id="peer")
    session = _ServerSession(client=None, hop=hop, max_length=100)
    assert session.history is None and session.length == 0
    steps = [torch.randn(2, 5, 4)] + [torch.randn(2, 1, 4) for _ in range(40)]  # past the first capacities
    for step in steps:
        session._remember(step, None, None)
    expected = torch.cat(steps, dim=1)
    assert session.length == 45 and torch.equal(session.history, expected)
    rewind = torch.randn(2, 3, 4)
    session._remember(rewind, None, 10)  # start_from_position: the tokens after 10 are replaced
    expected = torch.cat([expected[:, :10], rewind], dim=1)
    assert session.length == 13 and torch.equal(session.history, expected)
    beam = torch.randn(2, 1, 4)
    session._remember(beam, torch.tensor([1, 1]), None)  # both rows continue old row 1
    expected = torch.cat([expected[[1, 1]], beam], dim=1)
    assert torch.equal(session.history, expected)
    with pytest.raises(InputError, match="do not continue this session's batch of 2 rows"):
        session._remember(torch.randn(3, 1, 4), None, None)


def test_a_server_sessions_answers_follow_its_inputs_and_a_reorder_unchecks_them():
    """The outputs a session keeps for spot checks are rewound and reordered with its inputs; positions a spot check
    confirmed stay confirmed up to a rewind, and none after a beam reorder (every row may now hold another's)."""
    from types import SimpleNamespace

    from hivekeeper.core.swarm.client.inference import _ServerSession

    hop = SimpleNamespace(span=SimpleNamespace(info=SimpleNamespace(torch_dtype="float32")), start=0, end=2,
                          peer_id="peer")
    session = _ServerSession(client=None, hop=hop, max_length=100)
    inputs, outputs = [torch.randn(2, 3, 4), torch.randn(2, 2, 4)], [torch.randn(2, 3, 4), torch.randn(2, 2, 4)]
    for x, y in zip(inputs, outputs):
        session._remember(x, None, None, y)
    assert torch.equal(session.outputs, torch.cat(outputs, dim=1))
    session.checked = 5  # a spot check confirmed every position
    session._remember(torch.randn(2, 1, 4), None, None, torch.randn(2, 1, 4))
    assert session.checked == 5  # a plain step keeps what was confirmed
    last = torch.randn(2, 1, 4)
    session._remember(torch.randn(2, 1, 4), None, 4, last)  # rewind to 4: positions 4 and 5 are new
    assert session.checked == 4 and session.length == 5
    assert torch.equal(session.outputs, torch.cat([torch.cat(outputs, dim=1)[:, :4], last], dim=1))
    before = session.outputs.clone()
    beam = torch.randn(2, 1, 4)
    session._remember(torch.randn(2, 1, 4), torch.tensor([1, 1]), None, beam)
    assert session.checked == 0
    assert torch.equal(session.outputs, torch.cat([before[[1, 1]], beam], dim=1))
