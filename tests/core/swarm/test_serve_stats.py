"""Issue 14 item 11: a running `hivekeeper serve` says what it has served (open sessions and requests served) every
minute by default, not "0 sessions" from its start line only; a real server on loopback serves a real client."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from hivekeeper.core.cli.serve import DEFAULT_STATS_PERIOD_S, human_status_line
from hivekeeper.core.swarm.local import LocalSwarm

from ...child_output import run

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def test_stats_lines_count_the_requests_served(tiny_checkpoint, tmp_path):
    from hivekeeper.core.swarm.client.inference import SwarmModel

    with LocalSwarm(tiny_checkpoint, extra_args=("--torch-threads", "1"), log_dir=tmp_path) as swarm:
        server = swarm.start("--stats-period", "0.3")
        first = server.wait_for("stats", timeout=30)
        assert first["requests_served"] == 0
        with SwarmModel(str(tiny_checkpoint), initial_peers=server.maddrs) as model:
            model.generate(torch.tensor([[1, 17, 42]]), 5)
        deadline, event = time.monotonic() + 30, first
        while event.get("requests_served", 0) == 0 and time.monotonic() < deadline:
            event = server.wait_for("stats", timeout=30, after=len(server.events))
        assert event["requests_served"] > 0, server.log()
        line = human_status_line(event)
        assert f"{event['requests_served']} requests served" in line and "open sessions" in line


def test_stats_are_on_by_default():
    help_text = run([sys.executable, "-m", "hivekeeper.core.cli.main", "serve", "--help"], timeout=120).stdout
    assert DEFAULT_STATS_PERIOD_S > 0 and f"default {DEFAULT_STATS_PERIOD_S:g}" in help_text
