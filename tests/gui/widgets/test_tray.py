"""The node's tray and status bar (issue 20 item 3), through the real window with a real `serve` child: offscreen
there is no tray, so the status bar says serving / paused (why) / offline and holds the menu. Pause for 1 hour goes
to the node (serve --control-stdin), which steps aside and says why; Resume brings it back; a node killed from
outside is restarted after its backoff, and each of these is a notification."""

from __future__ import annotations

import os
import signal
import time

from hivekeeper.gui.services.node import NodeLaunch

START_MS = 90_000  # a node on a busy machine: python, torch, p2pd, the demo model


def test_the_status_bar_shows_the_node_and_its_menu_pauses_resumes_and_a_crash_restarts_it(app_window, qtbot,
                                                                                           demo_checkpoint):
    window = app_window
    window.ask_on_close = lambda: "stop"  # pytest-qt closes the window before the fixture quits it: no dialog
    tray = window.node_tray
    assert window.tray is None and "Node: offline" in tray.label.text()  # offscreen: no tray, the status bar
    assert [a.text() for a in tray.button.menu().actions()] == ["Show Hivekeeper", "Pause for 1 hour", "Resume",
                                                                "Stop the node and quit"]
    window.node.restart_backoff_s = 0.5
    window.node.start(NodeLaunch(str(demo_checkpoint), host="127.0.0.1", stats_period=0,
                                 extra_args=("--block-indices", "0:2", "--throughput", "1", "--update-period", "5")))
    qtbot.waitUntil(lambda: window.node.state == "online", timeout=START_MS)
    assert "Node: serving (online)" in tray.label.text() and tray.notifications[-1][0] == "Node joined"
    assert tray.pause_action.isEnabled() and not tray.resume_action.isEnabled()

    asked = time.time()
    tray.pause_action.trigger()
    qtbot.waitUntil(lambda: window.node.state == "paused", timeout=30_000)
    # an hour from when the pause was asked for; the minute may turn between asking and looking
    text, minutes = tray.label.text(), _minutes_between(asked + 3600, time.time() + 3600)
    until = next((minute for minute in minutes if f"Node: paused — paused by you until {minute}" in text), None)
    assert until is not None, (minutes, text)
    assert tray.notifications[-1] == ("Node paused", f"The node stepped aside: paused by you until {until}.")
    assert "Node paused" in window.statusBar().currentMessage() and tray.resume_action.isEnabled()

    tray.resume_action.trigger()
    qtbot.waitUntil(lambda: window.node.state == "online", timeout=30_000)
    assert "Node: serving (online)" in tray.label.text()

    os.kill(window.node.pid, signal.SIGKILL)  # a crash
    qtbot.waitUntil(lambda: window.node.state == "error", timeout=10_000)
    assert "restarting in" in tray.label.text() and tray.notifications[-1][0] == "Node crashed"
    qtbot.waitUntil(lambda: window.node.state == "online", timeout=START_MS)  # started again by itself
    assert window.node.crashes == 1 and "Node: serving (online)" in tray.label.text()


def _minutes_between(start: float, end: float) -> list[str]:
    """Every local "HH:MM" from the time `start` to the time `end` (seconds since the epoch)."""
    minutes = [time.strftime("%H:%M", time.localtime(start))]
    for moment in range(int(start) - int(start) % 60 + 60, int(end) + 1, 60):
        minutes.append(time.strftime("%H:%M", time.localtime(moment)))
    return minutes
