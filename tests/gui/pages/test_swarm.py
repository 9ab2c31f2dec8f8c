"""The Swarm page against real `hivekeeper serve` processes on 127.0.0.1 (a loopback swarm, the demo model).

Join starts the node as a child process and the coverage chart shows it beside the other server (a SwarmServer with
its own p2pd in this process); Leave stops it cleanly (exit 0, OFFLINE announced, read back from the DHT); a node
that dies shows its error and restarts; closing the window stops it.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from hivekeeper.core.swarm.dht import THROUGHPUT_CAP_FACTOR, ServerState, dht_prefix_for, read_blocks
from hivekeeper.gui.settings import Settings
from hivekeeper.gui.style import fmt_rate

from ...core.swarm.client.servers import InProcessServers

pytestmark = pytest.mark.slow

START_S = 180_000  # ms: a node imports torch and hivemind, starts p2pd and measures its speed on a busy machine


def _settings(model, peers=None) -> Settings:
    settings = Settings()
    settings.plan.model = str(model)
    settings.plan.hardware = "cpu-generic"
    settings.swarm.model = str(model)
    settings.swarm.host = "127.0.0.1"
    settings.swarm.num_blocks = 1
    settings.swarm.new_swarm = peers is None
    settings.swarm.initial_peers = list(peers or [])
    return settings


def _offline_in_the_dht(servers: InProcessServers, peer_id: str) -> bool:
    """The DHT (read by the other server's node) holds `peer_id`'s records, all OFFLINE."""
    server = next(iter(servers.running.values()))[0]
    blocks = servers.run(read_blocks(server.dht, servers.prefix, 2))
    states = [servers_of[peer_id].state for servers_of in blocks if peer_id in servers_of]
    return bool(states) and all(state == ServerState.OFFLINE for state in states)


def test_join_and_leave_a_local_swarm(make_window, qtbot, demo_checkpoint):
    swarm = InProcessServers(demo_checkpoint, dht_prefix_for(str(demo_checkpoint)))
    try:
        swarm.start((0, 1), "other", throughput=5.0)  # another server holds block 0
        window = make_window(_settings(demo_checkpoint, swarm.initial_peers))
        page = window.swarm_page
        monitor = window.monitor_page
        window.coverage.period_s = 1.0  # a report a second (the app's default is 3 s)
        window.show_page("Swarm")

        page.join_button.click()
        qtbot.waitUntil(lambda: window.node.state in ("starting", "joining", "online"), timeout=5_000)
        pid = window.node.pid
        assert "serve" in psutil.Process(pid).cmdline()  # a child process of the app, not in the app
        assert not page.join_button.isEnabled() and page.leave_button.isEnabled()
        qtbot.waitUntil(lambda: window.node.state == "online", timeout=START_S)
        assert window.node.last_event["blocks"] == [1, 2]  # it filled the block nobody served
        assert "online" in window.node_status.text()
        assert page.field_values["span"][0] == "blocks 1:2" and "blocks 1:2" in page.node_info.text()
        assert window.node.maddrs and page.address_box.toPlainText().startswith("--initial-peers /ip4/127.0.0.1")

        # the coverage chart: block 0 by the other server, block 1 by this node (highlighted)
        qtbot.waitUntil(lambda: page.coverage_data is not None and page.coverage_data[2][1] > 0, timeout=START_S)
        x, others, mine = page.coverage_data
        assert not page.coverage_plot.note.isVisible() and page.coverage_plot.getAxis("bottom").isVisible()
        assert list(x) == [0, 1] and others[0] == 5.0 and mine[0] == 0.0 and others[1] == 0.0
        assert page.field_values["servers"][0] == "2"
        # the node card and the chart agree: the card says what the node advertises and, where its claim is above
        # 10x the other server's 5 requests/s, the 50 the swarm counts, which is the bar the chart draws (issue 14)
        advertised = window.node.last_event["throughput"]
        counted = min(advertised, THROUGHPUT_CAP_FACTOR * 5.0)
        assert mine[1] == pytest.approx(counted)
        qtbot.waitUntil(lambda: page.counted_rps is not None, timeout=30_000)
        card = page.state_card.detail.text()
        assert f"advertises {fmt_rate(advertised)} requests/s" in card, card
        assert "e+" not in card and (f"the swarm counts {fmt_rate(counted)} of it" in card) == (counted < advertised)
        print(f"\n[swarm card] {card}")
        qtbot.waitUntil(lambda: len(monitor.buffers["node_requests"]) >= 1, timeout=30_000)  # stats lines
        peer_id = window.node.peer_id

        page.leave_button.click()
        qtbot.waitUntil(lambda: window.node.state == "stopped", timeout=60_000)
        assert window.node.exit_code == 0  # a clean exit, not a kill
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        qtbot.waitUntil(lambda: not page.coverage.running, timeout=30_000)  # the watcher went with it
        assert page.join_button.isEnabled()
        # nothing stale of the node that left (issue 14 item 10), and no "Restart the node" after a Leave
        assert page.restart_button.isHidden()
        assert page.coverage_data is None and len(page.mine_bars.opts["x"]) == 0
        assert page.coverage_plot.note.isVisible() and page.coverage_note.text() == ""  # says why it is empty
        assert all(value == "–" for value, _ in page.field_values.values())
        assert page.address_box.toPlainText() == ""

        # the swarm saw it go: its record says OFFLINE
        deadline = time.monotonic() + 60
        while not _offline_in_the_dht(swarm, peer_id):
            assert time.monotonic() < deadline, "the node's records did not turn OFFLINE"
            time.sleep(0.2)
    finally:
        swarm.close()


def test_a_dead_node_shows_its_error_restarts_and_closing_stops_it(make_window, qtbot, demo_checkpoint, tmp_path):
    missing = tmp_path / "no-such-model"
    window = make_window(_settings(missing))
    page = window.swarm_page
    page.join()
    qtbot.waitUntil(lambda: window.node.state == "error", timeout=START_S)
    assert str(missing) in window.node.error  # the CLI's one-line error, not a traceback
    assert str(missing) in page.error_label.text() and not page.restart_button.isHidden()
    assert "error" in window.node_status.text()

    page.model_edit.setText(str(demo_checkpoint))
    page.model_edit.editingFinished.emit()
    page.join()
    qtbot.waitUntil(lambda: window.node.state == "online", timeout=START_S)
    pid = window.node.pid
    os.killpg(pid, signal.SIGKILL)  # the node dies unexpectedly (with its p2pd)
    qtbot.waitUntil(lambda: window.node.state == "error", timeout=30_000)
    assert window.node.error and not page.restart_button.isHidden()

    page.restart_button.click()  # the same node again
    qtbot.waitUntil(lambda: window.node.state == "online", timeout=START_S)
    assert window.node.pid != pid and window.node.launch.model == str(demo_checkpoint)
    child = psutil.Process(window.node.pid)

    asked = []
    window.ask_on_close = lambda: asked.append(True) or "stop"
    window.close()
    assert asked == [True]  # closing with a node running asks first
    assert window.node.state == "stopped" and not window.node.running
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    alive = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    assert alive == []  # no node, no watcher, no p2pd
