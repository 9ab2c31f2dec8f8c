"""The swarm end to end: `hivekeeper serve` subprocesses on 127.0.0.1 serving a 6-block demo model, and a client.

One swarm is shared by the module (starting servers is the slow part) and the tests run in file order:
    a, b, c: --num-blocks 2 (they must pick 0:2, 2:4, 4:6), backup: --block-indices 2:4
    kill -9 of the session's 2:4 server mid-generation; then e (--num-blocks 2, 1 s balance checks) joins and
    c leaves: e must move to c's blocks.
a, b and c never move (--balance-period 0), so only e rebalances and the outcome is deterministic.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from hivekeeper.core.runtime.checkpoint import load_embedding, load_head, load_span
from hivekeeper.core.cli.main import main
from hivekeeper.core.runtime.model import KVCache
from hivekeeper.core.swarm.dht import ServerState, read_blocks
from hivekeeper.core.swarm.local import LocalSwarm
from hivekeeper.core.swarm.protocol import (
    chain_uid,
    deserialize_tensor,
    handler_name,
    pack_args,
    pack_metadata,
    serialize_tensor,
)

pytestmark = pytest.mark.slow

LAYERS = 6
PROMPT = torch.tensor([[1, 17, 42, 99, 7]])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from hivekeeper.core.runtime.demo_model import make_demo_checkpoint

    return make_demo_checkpoint(tmp_path_factory.mktemp("swarm") / "swarm-demo", layers=LAYERS)


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the servers compete for the same two cores
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def swarm(checkpoint, tmp_path_factory):
    cache_dir = tmp_path_factory.mktemp("cache")  # throughput measured by the first server, reused by the others
    local = LocalSwarm(checkpoint, extra_args=("--torch-threads", "1", "--update-period", "20"),
                       env={"XDG_CACHE_HOME": str(cache_dir)}, log_dir=tmp_path_factory.mktemp("logs"))
    try:
        names = {}
        for name in "abc":  # each chooses its blocks after the previous one announced its own
            if name == "c":  # the backup starts beside c: 4:6 stays the weakest span whether c sees it or not
                names["backup"] = local.start("--block-indices", "2:4", wait=None)
            names[name] = local.start("--num-blocks", "2", "--balance-period", "0", "--public-name", name,
                                      wait="joining")
        for server in local.servers:
            server.wait_for("online")
        local.named = names
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="module")
def model(swarm, checkpoint, one_thread):
    from hivekeeper.core.swarm.client.inference import SwarmModel

    model = SwarmModel(str(checkpoint), initial_peers=swarm.initial_peers)
    yield model
    model.close()


@pytest.fixture(scope="module")
def local_greedy(checkpoint, one_thread):
    """Greedy tokens of the whole model run in this process (the reference), for any number of new tokens."""
    span, embedding, head = load_span(checkpoint, 0, LAYERS), load_embedding(checkpoint), load_head(checkpoint)

    def generate(prompt: torch.Tensor, new_tokens: int, sampler=None) -> torch.Tensor:
        cache = KVCache.allocate(span.config, LAYERS, prompt.shape[0], prompt.shape[1] + new_tokens)
        tokens, hidden, ids = [], embedding(prompt), prompt
        with torch.inference_mode():
            for _ in range(new_tokens):
                logits = head(span(hidden, cache))[:, -1]
                next_ids = sampler(logits, ids) if sampler else logits.argmax(-1)
                tokens.append(next_ids)
                ids = torch.cat([ids, next_ids[:, None]], dim=1)
                hidden = embedding(next_ids[:, None])
        return torch.stack(tokens, dim=1)

    generate.span = span
    return generate


def test_servers_with_num_blocks_cover_the_model_without_a_gap(swarm, checkpoint, capsys):
    spans = sorted(swarm.named[name].blocks for name in "abc")
    assert spans == [(0, 2), (2, 4), (4, 6)]
    assert main(["swarm", "status", "--model", str(checkpoint), "--initial-peers", *swarm.initial_peers,
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["gaps"] == [] and report["num_blocks"] == LAYERS
    assert [len(b["servers"]) for b in report["blocks"]] == [1, 1, 2, 2, 1, 1]
    assert report["bottleneck"]["block"] in (0, 1, 4, 5)
    servers = {s["public_name"]: s for s in report["servers"]}
    a = servers["a"]
    assert a["state"] == "online" and (a["start"], a["end"]) == swarm.named["a"].blocks
    # every advertised field filled honestly
    assert a["throughput"] > 0 and a["inference_rps"] > 0 and a["forward_rps"] > 0
    assert a["torch_dtype"] == "float32" and a["quant_type"] == "none" and a["version"].startswith("2.3.0")
    assert a["cache_tokens_left"] > 0 and a["rtt"] is not None
    assert a["network_rps"] is None  # not measured and not declared (--network-mbps): not made up


def test_greedy_generation_through_the_swarm_equals_local(model, local_greedy):
    with model.inference_session(max_length=40) as session:
        tokens = model.generate(PROMPT, 24, session=session)
        assert len(session.route) >= 3 and session.recoveries == []
    assert torch.equal(tokens, local_greedy(PROMPT, 24))


def test_server_to_server_push_gives_the_same_tokens(swarm, model, local_greedy):
    """With use_push, each server passes its step output to the next (rpc_push); the client's copy is skipped."""
    served_before = {s.peer_id: s for s in swarm.servers}
    model.client.config.use_push = True
    try:
        with model.inference_session(max_length=40) as session:
            tokens = model.generate(PROMPT, 24, session=session)
            route = session.route
    finally:
        model.client.config.use_push = False
    assert torch.equal(tokens, local_greedy(PROMPT, 24))
    assert len(route) >= 2 and all(served_before[peer].alive for peer, _, _ in route)
    # the servers after the first really got steps from their predecessor (23 decode steps each)
    later = [model.client.run(model.client.ping(peer))[1]["hivekeeper_stats"]["pushed_steps_served"]
             for peer, _, _ in route[1:]]
    assert all(count > 0 for count in later), later


def test_seeded_sampling_through_the_swarm_equals_local(model, local_greedy):
    from hivekeeper.core.runtime.sampling import Sampler, SamplingParams

    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.1, seed=7)
    assert torch.equal(model.generate(PROMPT, 16, sampler=Sampler(params)),
                       local_greedy(PROMPT, 16, sampler=Sampler(params)))


def test_forward_without_cache_matches_local(model, local_greedy):
    for hidden in (torch.randn(2, 9, 64), torch.randn(5, 900, 64)):  # the second is 1.1 MiB: sent as a stream
        with torch.inference_mode():
            assert torch.allclose(model.span(hidden), local_greedy.span(hidden), atol=1e-4)


def test_session_truncate_and_reorder_match_a_local_cache(model, local_greedy):
    """RemoteSession behaves like KVCache: rewinding (start_from_position) and reordering rows (hypo_ids)."""
    torch.manual_seed(3)
    chunks = [torch.randn(2, 4, 64), torch.randn(2, 1, 64), torch.randn(2, 1, 64), torch.randn(2, 2, 64)]
    span = local_greedy.span
    cache = KVCache.allocate(span.config, LAYERS, 2, 16)
    with torch.inference_mode(), model.inference_session(max_length=16, batch=2) as session:
        for step, chunk in enumerate(chunks):
            if step == 2:  # forget the last token, and swap the rows
                cache.truncate(4), session.truncate(4)
                cache.reorder(torch.tensor([1, 0])), session.reorder(torch.tensor([1, 0]))
            expected = span(chunk, cache)
            assert torch.allclose(session.step(chunk), expected, atol=1e-5), f"step {step}"
            assert session.length == cache.length


def test_malformed_requests_against_a_live_server_then_a_valid_one(swarm, model, local_greedy):
    server = swarm.named["a"]
    peer = PeerID.from_base58(server.peer_id)
    prefix = model.client.config.dht_prefix
    start, end = server.blocks
    hidden = torch.randn(1, 3, model.config.hidden_size)

    def call(method, request, response_type=runtime_pb2.ExpertResponse):
        return model.client.run(asyncio.wait_for(model.client.p2p.call_protobuf_handler(
            peer, handler_name(method), request, response_type), 10))

    def forward_request(uid=chain_uid(prefix, start, end), tensors=None, metadata=b""):
        tensors = [serialize_tensor(hidden)] if tensors is None else tensors
        return runtime_pb2.ExpertRequest(uid=uid, tensors=tensors, metadata=metadata)

    bad_requests = [
        forward_request(metadata=b"\x93\xff\x00garbage"),
        forward_request(tensors=[serialize_tensor(torch.randn(1, 3, 7))]),
        forward_request(tensors=[runtime_pb2.Tensor(buffer=b"\1" * 12, size=[1, 3, 64], dtype="float32")]),
        forward_request(tensors=[runtime_pb2.Tensor(buffer=b"\1" * 16, size=[2], dtype="complex64")]),
        forward_request(uid=chain_uid(prefix, end, end + 1)),
        forward_request(uid="no-such-model.0"),
        forward_request(tensors=[serialize_tensor(hidden.long())]),
    ]
    for request in bad_requests:
        with pytest.raises(Exception):
            call("rpc_forward", request)
    with pytest.raises(Exception, match="not served here"):
        call("rpc_info", runtime_pb2.ExpertUID(uid=chain_uid(prefix, 5, 6) if start != 4 else chain_uid(prefix, 0, 1)),
             runtime_pb2.ExpertInfo)

    async def inference(metadata):
        async def requests():
            flat, structure = pack_args(hidden, torch.empty(0), torch.empty(0, dtype=torch.int64))
            yield runtime_pb2.ExpertRequest(uid=chain_uid(prefix, start, end),
                                            tensors=[serialize_tensor(t) for t in flat],
                                            metadata=pack_metadata({**metadata, "args_structure": structure}))
            # keep our side open, as a real client does: ending the stream at once races with the server's error
            # reply (p2pd may reset the stream and drop the reply)
            await asyncio.sleep(30)

        responses = await model.client.p2p.iterate_protobuf_handler(
            peer, handler_name("rpc_inference"), requests(), runtime_pb2.ExpertResponse)
        return [r async for r in responses]

    for metadata, message in [({"max_length": 10**6}, "exceeds this server's limit"),
                              ({}, "max_length must be a positive int"),
                              ({"max_length": 8, "alloc_timeout": "soon"}, "alloc_timeout")]:
        with pytest.raises(Exception, match=message):
            model.client.run(asyncio.wait_for(inference(metadata), 10))

    # the server still answers a valid request, correctly
    response = call("rpc_forward", forward_request())
    blocks = load_span(model.path, start, end)
    with torch.inference_mode():
        assert torch.allclose(deserialize_tensor(response.tensors[0]), blocks(hidden), atol=1e-5)
    assert server.alive


def test_a_model_nobody_serves_fails_with_a_clear_error(swarm, checkpoint, one_thread):
    from hivekeeper.core.swarm.client.inference import SwarmError, SwarmModel

    with SwarmModel(str(checkpoint), initial_peers=swarm.initial_peers, dht_prefix="nobody-serves-this",
                    retry_seconds=1.0) as lonely:
        with pytest.raises(SwarmError, match="no server covers block 0"):
            lonely.generate(PROMPT, 2)


def test_kill_9_mid_generation_recovers_with_identical_tokens(swarm, model, local_greedy, capsys):
    by_peer = {server.peer_id: server for server in swarm.servers}
    killed = {}

    def on_token(step, ids):
        if step == 20:
            victim = next(peer for peer, start, end in session.route if (start, end) == (2, 4))
            by_peer[victim].kill()  # SIGKILL to the server and its p2pd: no goodbye, stale DHT records
            killed["peer"], killed["at"] = victim, time.perf_counter()
        elif "at" in killed and "next_token_s" not in killed:
            killed["next_token_s"] = time.perf_counter() - killed["at"]

    with model.inference_session(max_length=PROMPT.shape[1] + 64) as session:
        tokens = model.generate(PROMPT, 64, session=session, on_token=on_token)
        recoveries = session.recoveries
        route = session.route
    assert torch.equal(tokens, local_greedy(PROMPT, 64))
    assert len(recoveries) == 1 and recoveries[0]["peer_id"] == killed["peer"]
    assert recoveries[0]["blocks"] == [2, 4] and recoveries[0]["replayed_tokens"] == PROMPT.shape[1] + 20
    assert killed["peer"] not in [peer for peer, _, _ in route]
    with capsys.disabled():
        print(f"\n[swarm recovery] kill -9 -> next token {killed['next_token_s']:.2f}s, "
              f"re-route + replay {recoveries[0]['seconds']:.3f}s")


def test_a_server_leaves_and_another_moves_to_cover_the_gap(swarm, model, local_greedy):
    e = swarm.start("--num-blocks", "2", "--balance-period", "1", "--public-name", "e")
    try:
        _check_rebalancing(swarm, model, local_greedy, e)
    finally:
        e.stop()


def _check_rebalancing(swarm, model, local_greedy, e):
    assert e.blocks == (0, 2)  # every block equally strong: the lowest window
    c = swarm.named["c"]
    events_before = len(e.events)
    assert c.stop() == 0  # SIGTERM: announces OFFLINE, exits cleanly (no p2pd left: checked by the fixture)
    # (a busy machine may slip a periodic "stats" event in between)
    assert [event["state"] for event in c.events if event["state"] != "stats"][-2:] == ["online", "offline"]
    moved = e.wait_for("online", timeout=60, after=events_before)
    assert moved["blocks"] == [4, 6]

    blocks = model.client.run(read_blocks(model.client.dht, model.client.config.dht_prefix, LAYERS))
    online = [{peer for peer, info in servers.items() if info.state == ServerState.ONLINE} for servers in blocks]
    assert all(online), f"gap after rebalancing: {online}"
    assert all(info.state == ServerState.OFFLINE for info in (blocks[4].get(c.peer_id), blocks[5].get(c.peer_id))
               if info is not None)
    model.client.run(model.client.view(refresh=True))  # e's new blocks must be seen
    assert torch.equal(model.generate(PROMPT, 8), local_greedy(PROMPT, 8))
