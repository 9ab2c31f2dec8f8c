"""Issue 14 item 11: a running `hivekeeper serve` says what it has served (open sessions and requests served) every
minute by default, not "0 sessions" from its start line only; a real server (a SwarmServer with its own p2pd, in
this process) on loopback serves a real client, and its stats events read as the CLI prints them. The app's Swarm
page test (tests/gui/pages/test_swarm.py) reads those lines from a real `serve` process."""

from __future__ import annotations

import time

import pytest
import torch

from hivekeeper.core.cli.main import main
from hivekeeper.core.cli.serve import DEFAULT_STATS_PERIOD_S, human_status_line
from hivekeeper.core.swarm.dht import dht_prefix_for

from .client.servers import InProcessServers

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def wait_for_stats(events: list[dict], after: int, timeout: float = 30.0) -> dict:
    """The first "stats" event from index `after` on."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [event for event in events[after:] if event["state"] == "stats"]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no stats event within {timeout:g}s: {events[after:]}")


def test_stats_lines_count_the_requests_served(tiny_checkpoint):
    from hivekeeper.core.swarm.client.inference import SwarmModel

    servers = InProcessServers(tiny_checkpoint, dht_prefix_for(str(tiny_checkpoint)))
    try:
        peer_id = servers.start((0, 2), "counted", stats_period=0.3)
        events = servers.events[peer_id]
        first = wait_for_stats(events, 0)
        assert first["requests_served"] == 0
        with SwarmModel(str(tiny_checkpoint), initial_peers=servers.initial_peers) as model:
            model.generate(torch.tensor([[1, 17, 42]]), 5)
        deadline, event = time.monotonic() + 30, first
        while event.get("requests_served", 0) == 0 and time.monotonic() < deadline:
            event = wait_for_stats(events, len(events))
        assert event["requests_served"] > 0, events
        line = human_status_line(event)
        assert f"{event['requests_served']} requests served" in line and "open sessions" in line
    finally:
        servers.close()


def test_stats_are_on_by_default(capsys):
    with pytest.raises(SystemExit) as done:
        main(["serve", "--help"])
    assert done.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())  # as one line, however argparse wrapped it
    assert DEFAULT_STATS_PERIOD_S > 0 and f"default {DEFAULT_STATS_PERIOD_S:g}" in help_text
