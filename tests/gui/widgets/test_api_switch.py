"""The Chat page's API switch in the window as `hivekeeper app` opens it: ticked, it serves the page's model (the
tiny demo checkpoint) with `hivekeeper api` in a child process, shows the URL, and a real HTTP request to that URL
lists the model; unticked, the child is gone. A port already taken ends the child, and its one error line shows.
Quitting the app while the API loads leaves no child behind."""

from __future__ import annotations

import json
import os
import socket
import urllib.request

import pytest

from hivekeeper.gui.settings import Settings, SettingsStore

pytestmark = pytest.mark.slow
DEADLINE_MS = 240_000  # a child that imports torch and loads the model, on a busy machine


@pytest.fixture
def app_window(qapp, qtbot, config_dir, demo_checkpoint, measured_machine):
    """The main window as gui/app.py's main() makes it, from settings saved beforehand (chat with the demo model), on
    a machine measured before (the API's plan reads the profile instead of measuring the host first)."""
    from hivekeeper.gui.app import open_window

    measured_machine(config_dir)

    saved = Settings()
    saved.chat.model, saved.chat.mode = str(demo_checkpoint), "local"
    SettingsStore().save(saved)
    window = open_window(qapp)
    qtbot.addWidget(window)
    yield window
    window.quit_everything()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def switch_on(window, qtbot, port: int):
    window.show_page("Chat")
    switch = window.chat_page.api_switch
    switch.port_spin.setValue(port)
    switch.checkbox.click()
    qtbot.waitUntil(lambda: switch.service.state in ("serving", "error"), timeout=DEADLINE_MS)
    return switch


def test_the_switch_serves_the_chat_model_and_stops_it(app_window, qtbot, demo_checkpoint):
    switch = switch_on(app_window, qtbot, free_port())
    assert switch.service.state == "serving", switch.service.error
    url = switch.url_label.text()
    assert url.startswith("http://127.0.0.1:") and switch.url_label.isVisible()
    with urllib.request.urlopen(f"{url}/models", timeout=60) as reply:
        assert str(demo_checkpoint) in [entry["id"] for entry in json.load(reply)["data"]]
    pid = switch.service.pid
    switch.checkbox.click()
    qtbot.waitUntil(lambda: switch.service.state == "stopped", timeout=60_000)
    assert not switch.checkbox.isChecked() and not switch.url_label.isVisible()
    with pytest.raises(ProcessLookupError):  # ended and reaped, not a zombie
        os.kill(pid, 0)


def test_a_port_in_use_shows_the_commands_error_line(app_window, qtbot):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        switch = switch_on(app_window, qtbot, port)
    assert switch.service.state == "error"
    assert f"cannot listen on 127.0.0.1:{port}" in switch.status_label.text()
    assert not switch.checkbox.isChecked() and switch.port_spin.isEnabled()


def test_quitting_the_app_stops_the_api(app_window, qtbot):
    switch = app_window.chat_page.api_switch
    switch.port_spin.setValue(free_port())
    switch.checkbox.click()
    assert switch.service.state == "loading" and switch.service.pid is not None
    pid = switch.service.pid
    app_window.quit_everything()  # what the tray's "quit" and SIGTERM do
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
