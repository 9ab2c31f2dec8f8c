"""Issue 20 item 1: the swarm's model list (core/swarm/directory.py): registry entries written by anyone are checked
one by one, each model's row says its coverage and weakest span, and the one-click choice prefers filling a gap."""

from __future__ import annotations

from hivemind.utils import ValueWithExpiration

from hivekeeper.core.swarm.dht import ServerInfo, ServerState
from hivekeeper.core.swarm.directory import (MAX_MODELS, RegistryEntry, best_row, model_row, parse_registry,
                                             weakest_span, where_to_help)


def _registry(items: dict) -> ValueWithExpiration:
    return ValueWithExpiration({key: ValueWithExpiration(value, 1e12) for key, value in items.items()}, 1e12)


def test_hostile_registry_entries_drop_only_themselves():
    good = {"num_blocks": 32, "repository": "org/model"}
    entries = parse_registry(_registry({
        "model-hf": good, "bad-count": {"num_blocks": 0, "repository": "x"}, "bool": {"num_blocks": True,
                                                                                  "repository": "x"},
        "huge": {"num_blocks": 10**9, "repository": "x"}, "no-repo": {"num_blocks": 4}, "long": {
            "num_blocks": 4, "repository": "r" * 1000}, "not-a-dict": [1, 2], "bad/prefix": good, 7: good}))
    assert entries == [RegistryEntry("model-hf", "org/model", 32)]
    assert parse_registry(None) == [] and parse_registry(ValueWithExpiration("junk", 1e12)) == []
    flood = parse_registry(_registry({f"m{i:04d}": good for i in range(5 * MAX_MODELS)}))
    assert len(flood) == MAX_MODELS


def test_a_row_names_coverage_and_the_weakest_span_and_help_goes_where_it_adds_most():
    online = ServerInfo(ServerState.ONLINE, 4.0)
    offline = ServerInfo(ServerState.OFFLINE, 100.0)
    blocks = [{"a": online}, {"a": online, "b": ServerInfo(ServerState.ONLINE, 2.0)}, {"c": offline}, {}]
    row = model_row(RegistryEntry("m", "org/m", 4), blocks)
    assert (row["servers"], row["covered_blocks"], row["gaps"]) == (2, 2, [2, 3])
    assert row["weakest"] == {"start": 2, "end": 4, "throughput": 0}
    assert weakest_span([3.0, 1.0, 1.0, 2.0, 1.0]) == {"start": 1, "end": 3, "throughput": 1.0}

    help_gap = where_to_help(row, can_hold=2, rps=1.0)
    assert help_gap["blocks"] == [2, 4]  # the two blocks nobody serves
    covered = model_row(RegistryEntry("n", "org/n", 4), [{"a": online}] * 4)
    help_slow = where_to_help(covered, can_hold=8, rps=4.0)  # more than the model: all of it, throughput doubled
    assert help_slow["blocks"] == [0, 4] and help_slow["gain"] == 2.0
    assert where_to_help(covered, can_hold=0, rps=4.0)["blocks"] is None

    row["help"], covered["help"] = help_gap, help_slow
    unknown = {**covered, "dht_prefix": "u", "help": {"blocks": None, "reason": "cannot size"}}
    assert best_row([covered, unknown, row])["dht_prefix"] == "m"  # a gap filled beats a bottleneck doubled
    assert best_row([unknown]) is None


def test_swarm_models_lists_a_loopback_swarm_and_where_this_machine_helps(tiny_checkpoint, capsys):
    """The CLI twin of the Swarm page's list: a real server of block 0 registers its model; block 1 is the gap."""
    import asyncio
    import json
    import threading

    from hivekeeper.core.cli.main import main
    from hivekeeper.core.swarm.protocol import new_event_loop
    from hivekeeper.core.swarm.server.server import ServerConfig, SwarmServer

    loop = new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    online = threading.Event()
    server = SwarmServer(ServerConfig(checkpoint=tiny_checkpoint, dht_prefix="tiny", repository=str(tiny_checkpoint),
                                      host="127.0.0.1", block_indices=(0, 1), throughput=3.0),
                         status=lambda event: event["state"] == "online" and online.set())
    future = asyncio.run_coroutine_threadsafe(server.run(), loop)
    try:
        assert online.wait(60)
        assert main(["swarm", "models", "--initial-peers", server.maddrs[0], "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert main(["swarm", "models", "--initial-peers", server.maddrs[0]]) == 0
        text = capsys.readouterr().out
    finally:
        loop.call_soon_threadsafe(server.stop)
        future.result(30)

        async def cancel_the_rest() -> None:  # hivemind leaves DHT refresh tasks behind
            others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_the_rest(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
    (row,) = report["models"]
    assert (row["dht_prefix"], row["repository"], row["servers"], row["gaps"]) == ("tiny", str(tiny_checkpoint), 1, [1])
    assert row["weakest"] == {"start": 1, "end": 2, "throughput": 0} and report["best"] == "tiny"
    assert row["help"]["blocks"][1] == 2  # whatever fits here, it ends on the gap
    assert "this machine helps most with tiny" in text and "1 of 2" in text
