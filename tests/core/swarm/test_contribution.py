"""Issue 20 item 4: a node counts the requests and tokens it serves, and the totals add up across restarts in one
atomic file that `hivekeeper node stats` reads. A real server on loopback (in this process) serves a real client,
stops, starts again with a fresh handler, serves again."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import torch

from hivekeeper.core.cli.main import main
from hivekeeper.core.swarm.contribution import (ContributionLedger, PowerSource, counting_status, read_contribution)
from hivekeeper.core.swarm.protocol import new_event_loop
from hivekeeper.core.swarm.server.server import ServerConfig, SwarmServer
from hivekeeper.planner.errors import InputError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WATTS = 36.0  # 36 W: 0.01 Wh a second


def _serve_once(checkpoint, ledger_path, prompt, new_tokens) -> tuple[int, int, list[dict]]:
    """Start a server (a fresh handler), let a client generate, stop it: (requests, tokens) it counted, its events."""
    from hivekeeper.core.swarm.client.inference import SwarmModel

    loop = new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    events: list[dict] = []
    online = threading.Event()

    def seen(event: dict) -> None:
        events.append(event)
        if event["state"] == "online":
            online.set()

    ledger = ContributionLedger(ledger_path, PowerSource(WATTS), save_period_s=3600)  # saves on stop only
    config = ServerConfig(checkpoint=checkpoint, dht_prefix="contrib", host="127.0.0.1", block_indices=(0, 2),
                          throughput=1.0)
    server = SwarmServer(config, status=counting_status(ledger, lambda: server.handler, seen))
    future = asyncio.run_coroutine_threadsafe(server.run(), loop)
    try:
        assert online.wait(60), future.exception() if future.done() else "server not online"
        with SwarmModel(str(checkpoint), initial_peers=server.maddrs, dht_prefix="contrib") as model:
            model.generate(prompt, new_tokens)
        counted = (server.handler.requests_served, server.handler.tokens_served)
    finally:
        loop.call_soon_threadsafe(server.stop)
        future.result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
    return (*counted, events)


def _node_stats(path, capsys) -> dict:
    assert main(["node", "stats", "--json", "--file", str(path)]) == 0
    return json.loads(capsys.readouterr().out)


def test_totals_add_up_across_a_restart_and_node_stats_shows_them(tiny_checkpoint, tmp_path, capsys):
    path = tmp_path / "contribution.json"
    prompt = torch.tensor([[1, 17, 42]])
    first = _serve_once(tiny_checkpoint, path, prompt, 4)
    after_one = _node_stats(path, capsys)
    second = _serve_once(tiny_checkpoint, path, prompt, 6)
    after_two = _node_stats(path, capsys)

    # a prompt of 3 then one token a step: each server step is a request; tokens are rows × positions
    assert first[:2] == (4, 3 + 3) and second[:2] == (6, 3 + 5), (first[:2], second[:2])
    assert after_one["total"]["requests"] == 4 and after_one["total"]["tokens"] == 6
    total, today = after_two["total"], after_two["today"]
    assert (total["requests"], total["tokens"]) == (4 + 6, 6 + 8)
    assert today["requests"] == total["requests"]  # all of it served today
    assert total["uptime_s"] > after_one["total"]["uptime_s"] > 0
    assert total["energy_wh"] == pytest.approx(total["uptime_s"] * WATTS / 3600)
    final = second[2][-1]  # the offline event carries the contribution after it
    assert final["state"] == "offline" and final["contribution"]["total"]["tokens"] == 14


def test_a_broken_file_is_one_error_naming_it_and_the_ledger_never_half_writes(tmp_path, capsys):
    path = tmp_path / "contribution.json"
    path.write_text('{"total": {"requests": -3}, "days": {}}')
    assert main(["node", "stats", "--file", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert str(path) in err and "'requests'" in err and len(err.splitlines()) == 1
    ledger = ContributionLedger(path, PowerSource(None))
    with pytest.raises(InputError):  # it adds to the file it reads: a broken one is left for the user to see
        ledger.save()
    assert json.loads(path.read_text())["total"]["requests"] == -3
    path.unlink()
    clock = iter([100.0, 160.0, 190.0])
    ledger = ContributionLedger(path, PowerSource(None), clock=lambda: next(clock))
    ledger.record({"state": "online", "requests_served": 0, "tokens_served": 0})
    ledger.record({"state": "stats", "requests_served": 5, "tokens_served": 40})
    summary = ledger.record({"state": "offline", "requests_served": 7, "tokens_served": 41})
    assert summary["total"] == {"requests": 7, "tokens": 41, "uptime_s": 90.0, "energy_wh": 0.0}  # serving 100-190
    assert read_contribution(path)["total"] == summary["total"]


def test_the_ledger_saves_at_its_first_event_then_once_a_save_period_and_at_the_end(tmp_path):
    """When a running node's counts reach the file: its first status event saves at once (a node that crashes later
    still left its file), then the first event a save period after the last save, and the final event always."""
    path = tmp_path / "contribution.json"
    clock = iter([100.0, 101.0, 109.0, 111.0, 115.0, 116.0])
    ledger = ContributionLedger(path, PowerSource(WATTS), save_period_s=10.0, clock=lambda: next(clock))
    started = ledger.record({"state": "started", "requests_served": 0, "tokens_served": 0})
    assert started is not None and started["total"]["uptime_s"] == 0  # saved; nothing served yet
    assert ledger.record({"state": "online", "requests_served": 0, "tokens_served": 0}) is None
    assert ledger.record({"state": "stats", "requests_served": 2, "tokens_served": 9}) is None  # 9 s after the save
    running = ledger.record({"state": "stats", "requests_served": 3, "tokens_served": 10})  # 11 s after it
    assert running["total"] == {"requests": 3, "tokens": 10, "uptime_s": 10.0, "energy_wh": pytest.approx(0.1)}
    assert read_contribution(path)["total"] == running["total"]
    assert ledger.record({"state": "stats", "requests_served": 3, "tokens_served": 10}) is None
    final = ledger.record({"state": "offline", "requests_served": 4, "tokens_served": 12})  # 5 s after: saves anyway
    assert final["total"]["uptime_s"] == 15.0 and (final["total"]["requests"], final["total"]["tokens"]) == (4, 12)


@pytest.mark.slow
def test_serve_keeps_its_contribution_in_the_data_folder(tiny_checkpoint, tmp_path):
    """The real command: its status lines carry the contribution once saved (its first event saves at once; the
    ledger's save period is the test above's), and the file holds the time serving after a stop."""
    from hivekeeper.core.swarm.local import LocalSwarm

    data = tmp_path / "data"
    with LocalSwarm(tiny_checkpoint, extra_args=("--torch-threads", "1"), log_dir=tmp_path,
                    env={"HIVEKEEPER_DATA_DIR": str(data)}) as swarm:
        server = swarm.start("--block-indices", "0:2", "--throughput", "1", "--stats-period", "0.3")
        saved = next(event for event in server.events if "contribution" in event)
        assert saved is server.events[0] and saved["contribution"]["total"]["uptime_s"] == 0  # before serving
        server.wait_for("stats", timeout=30)  # serving for a while
        assert server.stop() == 0
    doc = read_contribution(data / "contribution.json")
    total = doc["total"]
    assert total["uptime_s"] > 0 and total["energy_wh"] > 0  # the plan's CPU power × the time serving: the stop's save
    assert (total["requests"], total["tokens"]) == (0, 0)  # no client: nothing served
