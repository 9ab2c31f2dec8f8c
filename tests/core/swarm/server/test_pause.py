"""A node that steps aside for its owner (issue 20 item 2): the pause conditions, their providers, and a real
server pausing gracefully and rejoining.

The conditions are driven through the provider interface with `Owner`, a provider whose readings the test sets (no
mock of the server). The servers are real SwarmServers of the tiny model on 127.0.0.1 (tests/core/swarm/client/
servers.py). A real SwarmClient generates through them while one pauses: the DHT says OFFLINE, the client fails
over without losing a token (its tokens equal the model run here), the span's memory is freed, and the server comes
back ONLINE when the condition clears.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import threading
import time
import weakref

import pytest
import torch

from hivekeeper.core.runtime.checkpoint import load_embedding, load_head, load_span
from hivekeeper.core.runtime.model import KVCache
from hivekeeper.core.swarm.client.inference import SwarmModel
from hivekeeper.core.swarm.dht import ServerState, read_blocks
from hivekeeper.core.swarm.server.pause import (
    PauseSettings,
    PauseWatch,
    Readings,
    add_pause_arguments,
    linux_on_battery,
    parse_hours,
    parse_loginctl,
    pause_reason,
    within_hours,
)

from ..client.servers import InProcessServers

PREFIX = "pause-test"
NIGHT = datetime.datetime(2026, 12, 1, 23, 30)
AWAY = Readings(idle_seconds=3600.0, on_battery=False, other_cpu_percent=5.0, now=NIGHT)
ALL = PauseSettings(idle_minutes=5, on_battery=True, cpu_above=50, serve_hours="22-7", check_period=0.1)


class Owner:
    """A condition provider whose readings the test sets: the owner away, on mains power, at night by default."""

    def __init__(self):
        self.readings = AWAY

    def set(self, **changes) -> None:
        self.readings = Readings(**{**self.readings.__dict__, **changes})

    def read(self) -> Readings:
        return self.readings


# ---- the conditions ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, words", [
    ({"idle_seconds": 30.0}, "you are using this computer (idle under 5 min)"),
    ({"on_battery": True}, "on battery"),
    ({"other_cpu_percent": 80.0}, "other programs use 80% CPU (limit 50%)"),
    ({"now": datetime.datetime(2026, 12, 1, 12, 0)}, "outside serving hours (22-7)"),
])
def test_each_condition_pauses_through_the_provider_and_clears(changes, words):
    owner = Owner()
    watch = PauseWatch(ALL, owner)
    assert watch.reason() is None
    owner.set(**changes)
    assert watch.reason() == words
    owner.readings = AWAY
    assert watch.reason() is None
    # a condition not asked for never pauses, and an unknown reading never does
    assert PauseWatch(PauseSettings(), owner).reason() is None
    assert pause_reason(ALL, Readings(now=NIGHT)) is None


def test_a_pause_by_hand_lasts_its_time_and_resume_ends_it():
    watch = PauseWatch(PauseSettings(), Owner())
    watch.pause_for(3600)
    assert watch.reason() == f"paused by you until {time.strftime('%H:%M', time.localtime(time.time() + 3600))}"
    watch.resume()
    assert watch.reason() is None


def test_serving_hours_across_midnight_and_bad_hours():
    assert parse_hours("9:30-17") == (570, 1020)
    at = lambda h, m=0: datetime.datetime(2026, 12, 1, h, m)  # noqa: E731
    assert within_hours("22-7", at(23)) and within_hours("22-7", at(6, 59)) and not within_hours("22-7", at(7))
    assert within_hours("9:30-17", at(9, 30)) and not within_hours("9:30-17", at(17))
    for bad in ("25-3", "9-9", "nine-five", "9:75-10"):
        with pytest.raises(ValueError):
            parse_hours(bad)


def test_logind_idle_hint_is_read_from_loginctl_output():
    assert parse_loginctl("IdleHint=no\nIdleSinceHintMonotonic=0\n", 500.0) == 0.0
    assert parse_loginctl("IdleHint=yes\nIdleSinceHintMonotonic=200000000\n", 500.0) == pytest.approx(300.0)
    assert parse_loginctl("", 500.0) is None  # no session (a headless service): unknown, never pauses


def test_battery_is_read_from_power_supply_files(tmp_path):
    def supply(name: str, **files: str) -> None:
        (tmp_path / name).mkdir()
        for key, value in files.items():
            (tmp_path / name / key).write_text(value + "\n")

    assert linux_on_battery(tmp_path) is None  # a desktop: no battery
    supply("BAT0", type="Battery", status="Discharging")
    supply("hidpp_battery_0", type="Battery", scope="Device", status="Charging")  # a mouse: not counted
    assert linux_on_battery(tmp_path) is True
    supply("AC", type="Mains", online="1")
    assert linux_on_battery(tmp_path) is False


def test_bad_values_name_the_flag():
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_pause_arguments(parser)
    args = parser.parse_args(["--pause-when-active", "5", "--serve-hours", "22-7", "--max-ram-gib", "2"])
    assert (args.pause_when_active, args.serve_hours, args.max_ram_gib) == (5.0, "22-7", 2.0)
    for argv, words in ((["--pause-cpu-above", "150"], "between 0 and 100"), (["--serve-hours", "9-9"], "same time"),
                        (["--max-cpu-threads", "0"], "at least 1")):
        with pytest.raises(argparse.ArgumentError, match=words) as caught:
            parser.parse_args(argv)
        assert argv[0] in str(caught.value)


def test_the_node_config_file_takes_the_same_keys_and_names_a_bad_one(tmp_path, capsys):
    from hivekeeper.core.cli.main import main

    config = tmp_path / "node.json"
    config.write_text('{"model": "x", "new-swarm": true, "pause-when-active": 5, "pause-cpu-above": 150}')
    assert main(["serve", "--config", str(config)]) == 2
    assert capsys.readouterr().err.strip() == (f"hivekeeper serve: error: {config}: argument --pause-cpu-above: 150 is "
                                               "out of range: must be between 0 and 100")
    config.write_text('{"model": "x", "new-swarm": true, "serve-hours": "7-7"}')
    assert main(["serve", "--config", str(config)]) == 2
    assert "argument --serve-hours: '7-7': the start and the end are the same time" in capsys.readouterr().err


# ---- a real server steps aside -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def swarm(tiny_checkpoint, one_torch_thread):
    servers = InProcessServers(tiny_checkpoint, PREFIX)
    servers.owners = {}
    try:
        for name in ("a", "b"):
            owner = Owner()
            peer = servers.start((0, 2), name, pause_watch=PauseWatch(ALL, owner))
            servers.owners[peer] = owner
        yield servers
    finally:
        servers.close()


@pytest.fixture(autouse=True)
def owners_away(swarm):
    """Each test starts and ends with both owners away, so one failing test cannot leave a server paused for the
    next; and with both servers ONLINE."""
    yield
    for owner in swarm.owners.values():
        owner.readings = AWAY
    for server, _ in swarm.running.values():
        swarm.loop.call_soon_threadsafe(server.command, {"command": "resume"})


def wait_for(what, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not what():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds:g}s")
        time.sleep(0.05)


def dht_state(swarm: InProcessServers, peer: str, reader: str) -> ServerState | None:
    server = swarm.running[reader][0]
    blocks = swarm.run(read_blocks(server.dht, PREFIX, 2))
    info = blocks[0].get(peer)
    return info.state if info else None


def states(swarm: InProcessServers, peer: str) -> list[str]:
    return [event["state"] for event in swarm.events[peer]]


def local_greedy(checkpoint, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    span, embedding, head = load_span(checkpoint, 0, 2), load_embedding(checkpoint), load_head(checkpoint)
    cache = KVCache.allocate(span.config, 2, 1, prompt.shape[1] + new_tokens)
    tokens, hidden = [], embedding(prompt)
    with torch.inference_mode():
        for _ in range(new_tokens):
            next_ids = head(span(hidden, cache))[:, -1].argmax(-1)
            tokens.append(next_ids)
            hidden = embedding(next_ids[:, None])
    return torch.stack(tokens, dim=1)


def test_a_pausing_server_leaves_gracefully_frees_its_span_and_rejoins(swarm, tiny_checkpoint):
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9]])
    paused: dict = {}
    # probes and the gap wait sized for a loaded 2-core box running servers, client and compute in one process:
    # the failover must not depend on the spare answering a ping within 1 s
    with SwarmModel(str(tiny_checkpoint), initial_peers=swarm.initial_peers, dht_prefix=PREFIX,
                    retry_seconds=20.0, probe_timeout=5.0, ping_timeout=5.0, gap_seconds=20.0) as model:
        for server, _ in swarm.running.values():
            wait_for(lambda: server.state == ServerState.ONLINE)
        assert all(rtt is not None for rtt in model.client.run(model.client.rtts(list(swarm.running))).values())
        with model.inference_session(prompt.shape[1] + 12) as session:
            def owner_comes_back(step: int, ids) -> None:
                if step != 3:
                    return
                (peer, _, _), = session.route
                server = swarm.running[peer][0]
                span = server.handler.served.span
                paused.update(peer=peer, span=span, weights=[weakref.ref(w) for w in span.parameters()])
                swarm.owners[peer].set(idle_seconds=10.0)  # input 10 s ago: the owner is at the keyboard
                wait_for(lambda: server.handler.served is None)  # no new sessions from here on

            tokens = model.generate(prompt, 12, session=session, on_token=owner_comes_back)
        failovers = [f["peer_id"] for f in model.client.failovers]
    peer = paused["peer"]
    other = next(p for p in swarm.running if p != peer)
    assert torch.equal(tokens, local_greedy(tiny_checkpoint, prompt, 12))  # no token lost or changed
    assert failovers == [peer]
    wait_for(lambda: "paused" in states(swarm, peer))
    paused_event = [e for e in swarm.events[peer] if e["state"] == "paused"][-1]
    assert paused_event["reason"] == "you are using this computer (idle under 5 min)" and paused_event["sessions"] == 0
    assert dht_state(swarm, peer, other) == ServerState.OFFLINE
    gc.collect()
    assert all(weight() is None for weight in paused["weights"])  # the weights are gone from the process
    assert all(w.device.type == "meta" for w in paused["span"].parameters())  # and what still points at the span

    swarm.owners[peer].readings = AWAY  # the owner leaves again: the server rejoins
    wait_for(lambda: states(swarm, peer)[-1] == "online")
    assert dht_state(swarm, peer, other) == ServerState.ONLINE
    assert swarm.running[peer][0].handler.served is not None


@pytest.mark.parametrize("condition", [{"on_battery": True}, {"other_cpu_percent": 90.0},
                                       {"now": datetime.datetime(2026, 12, 1, 15, 0)}, "by hand"])
def test_every_condition_takes_a_real_server_offline_in_the_dht_and_back(swarm, condition):
    peer, other = list(swarm.running)
    server = swarm.running[peer][0]
    wait_for(lambda: server.state == ServerState.ONLINE)
    onlines = states(swarm, peer).count("online")
    if condition == "by hand":
        swarm.loop.call_soon_threadsafe(server.command, {"command": "pause", "seconds": 3600})
    else:
        swarm.owners[peer].set(**condition)
    wait_for(lambda: states(swarm, peer)[-1] == "paused")
    assert dht_state(swarm, peer, other) == ServerState.OFFLINE
    if condition == "by hand":
        swarm.loop.call_soon_threadsafe(server.command, {"command": "resume"})
    else:
        swarm.owners[peer].readings = AWAY
    wait_for(lambda: states(swarm, peer).count("online") > onlines)
    assert dht_state(swarm, peer, other) == ServerState.ONLINE
