"""The app's coverage of a swarm (the Swarm page, fed by the window's own watcher child process) after a server is
killed with SIGKILL: within seconds the server no longer counts as online and its block shows as a gap, although
its DHT records still say ONLINE for minutes.

The killed server is a `hivekeeper serve` process; the one that stays up is a SwarmServer (with its own p2pd) in
this process. The killed one and the watcher start side by side."""

from __future__ import annotations

import time

import pytest

from hivekeeper.core.swarm.dht import dht_prefix_for
from hivekeeper.core.swarm.local import LocalSwarm

from ..core.swarm.client.servers import InProcessServers

pytestmark = pytest.mark.slow


def test_a_killed_server_leaves_the_coverage_within_seconds(make_window, qtbot, demo_checkpoint, tmp_path):
    common = ("--torch-threads", "1", "--throughput", "10", "--update-period", "60", "--balance-period", "0")
    servers = InProcessServers(demo_checkpoint, dht_prefix_for(str(demo_checkpoint)), update_period=60.0)
    try:
        servers.start((0, 1), "steady", throughput=10.0)
        with LocalSwarm(demo_checkpoint, extra_args=common, log_dir=tmp_path,
                        initial_peers=tuple(servers.initial_peers)) as swarm:
            doomed = swarm.start("--block-indices", "1:2", wait=None)
            window = make_window()
            page = window.swarm_page
            window.coverage.period_s = 1.0  # a report a second (the app's default is 3 s)
            window.coverage.watch(str(demo_checkpoint), servers.initial_peers)
            doomed.wait_for("online", timeout=120)
            qtbot.waitUntil(lambda: "2 servers online" in page.coverage_note.text(), timeout=120_000)
            assert "no server" not in page.coverage_note.text()

            doomed.kill()
            killed_at = time.monotonic()
            # (its records would keep it "online" for 2 x 60 s; the watcher's probe sees it gone in one period)
            qtbot.waitUntil(lambda: "1 server online" in page.coverage_note.text(), timeout=30_000)
            seconds = time.monotonic() - killed_at
            assert "no server for blocks 1" in page.coverage_note.text()
            assert list(page.coverage_data[1]) == [10.0, 0.0]  # block 1 has no throughput left
            report = window.coverage.last_report
            assert {s["state"] for s in report["servers"]} == {"online", "unreachable"}
            print(f"\n[app coverage] a killed server left the chart {seconds:.1f}s after the kill")
    finally:
        servers.close()
