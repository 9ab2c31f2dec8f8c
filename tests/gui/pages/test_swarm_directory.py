"""Issue 20 item 1, through the real window: the Swarm page lists the swarm's models from its registry with their
coverage and where this machine would help, and one click joins that span. A loopback swarm (a real server in this
process, registering its model) stands in for the public one through HIVEKEEPER_BOOTSTRAP_PEERS; the default,
where nothing listens, is "bootstrap peers unreachable" in one line."""

from __future__ import annotations

import os

import pytest

from hivekeeper.core.swarm.bootstrap import BOOTSTRAP_ENV

from ...core.swarm.client.servers import InProcessServers

START_MS = 180_000  # a node imports torch and hivemind and starts p2pd: slow on a busy machine
PREFIX = "tiny-llama-hf"  # the swarm's keys; the model's name is its repository's (the demo folder: tiny-llama)


@pytest.fixture
def loopback_swarm(demo_checkpoint, monkeypatch):
    """A server of block 0 of the 2-block demo model, listed in the registry as the public servers list theirs
    (under a prefix with '-hf', as a hub model's); the default swarm's peers point at it."""
    servers = InProcessServers(demo_checkpoint, PREFIX, update_period=10.0)
    try:
        peer = servers.start((0, 1), "directory", repository=str(demo_checkpoint))
        server = servers.running[peer][0]
        monkeypatch.setenv(BOOTSTRAP_ENV, server.maddrs[0])
        yield server
    finally:
        servers.close()


def _open_swarm_page(window):
    window.settings.swarm.new_swarm = False
    window.settings.swarm.initial_peers = []
    window.settings.swarm.host = "127.0.0.1"
    page = window.swarm_page
    page._load_settings()
    return page


def test_unreachable_bootstrap_peers_are_one_line_within_seconds(app_window, qtbot):
    page = _open_swarm_page(app_window)
    page.find_button.click()
    qtbot.waitUntil(lambda: "unreachable" in page.directory_note.text(), timeout=15_000)
    text = page.directory_note.text()
    assert text.startswith("bootstrap peers unreachable: " + os.environ[BOOTSTRAP_ENV]) and "\n" not in text
    assert page.models_table.rowCount() == 0 and not page.join_best_button.isEnabled()


@pytest.mark.slow
def test_the_swarm_models_are_listed_and_one_click_joins_where_this_machine_helps(app_window, qtbot,
                                                                                   loopback_swarm, demo_checkpoint):
    page = _open_swarm_page(app_window)
    app_window.coverage.directory_period_s = 2.0
    page.find_button.click()
    qtbot.waitUntil(lambda: page.models_table.rowCount() == 1, timeout=START_MS)
    assert page.directory_note.text() == "1 model served by 1 server"  # not "1 models ... 1 servers"
    cells = [page.models_table.item(0, c).text() for c in range(page.models_table.columnCount())]
    assert cells[:4] == ["tiny-llama", "1", "1 of 2", "1:2: no server"], cells
    assert cells[4].startswith("0:2, ~") and cells[4].endswith(" req/s"), cells  # the planner: both blocks fit
    # the model's name (its repository's), not the swarm prefix its keys use (the new user's pass, session 10)
    assert PREFIX in page.models_table.item(0, 0).toolTip() and PREFIX in page.join_best_button.toolTip()
    assert page.join_best_button.isEnabled() and page.join_best_button.text() == "Join tiny-llama, blocks 0:2"

    page.join_best_button.click()
    node = app_window.node
    assert node.launch.model == str(demo_checkpoint) and node.launch.initial_peers == (loopback_swarm.maddrs[0],)
    assert node.launch.extra_args == ("--block-indices", "0:2", "--dht-prefix", PREFIX)
    assert not page.join_best_button.isEnabled()
    qtbot.waitUntil(lambda: node.state == "online", timeout=START_MS)
    assert node.last_event["blocks"] == [0, 2] and node.last_event["dht_prefix"] == PREFIX
    # the list sees the new server: every block covered now
    qtbot.waitUntil(lambda: page.models_table.item(0, 2).text() == "2 of 2", timeout=30_000)
    assert page.models_table.item(0, 1).text() == "2"
    page.leave()
    qtbot.waitUntil(lambda: node.state == "stopped", timeout=60_000)
