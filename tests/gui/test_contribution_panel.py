"""Issue 20 item 4, through the real window: the Monitor page shows what this machine has served, today and in
total, from the file `hivekeeper serve` keeps (core/swarm/contribution.py), and follows a running node's status."""

from __future__ import annotations

import time

from hivekeeper.core.swarm.contribution import ContributionLedger, PowerSource


def test_the_monitor_shows_today_and_total_contribution_and_follows_the_node(app_window, qtbot, tmp_path):
    path = tmp_path / "contribution.json"
    now = time.time()
    clock = iter([now - 2.0, now])
    ledger = ContributionLedger(path, PowerSource(1800.0), clock=lambda: next(clock))  # 0.5 Wh a second
    ledger.record({"state": "online", "requests_served": 0, "tokens_served": 0})
    ledger.record({"state": "offline", "requests_served": 1234, "tokens_served": 56789})

    panel = app_window.monitor_page.contribution
    panel.path = path
    panel.reload()
    text = panel.table.text()
    assert text.count("1,234") == 2 and text.count("56,789") == 2  # today and total
    assert text.count("2 s") == 2 and text.count("1.0 Wh") == 2
    assert panel.summary["total"]["tokens"] == 56789

    running = {"today": {"requests": 1300, "tokens": 60000, "uptime_s": 3700, "energy_wh": 1500.0},
               "total": {"requests": 9000, "tokens": 700000, "uptime_s": 90000, "energy_wh": 25000.0}}
    app_window.node.statusReceived.emit({"state": "stats", "requests_served": 66, "contribution": running})
    text = panel.table.text()
    assert "9,000" in text and "700,000" in text and "25 h 00 min" in text and "25.00 kWh" in text
    assert "1 h 01 min" in text and "1.50 kWh" in text
