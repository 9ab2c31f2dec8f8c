"""The Settings page (issue 20 item 2): the node's pause conditions and limits, saved with the app's settings and
passed to the node as serve's flags (the headless node's config keys). Through the real window."""

from __future__ import annotations

import json

import pytest

from hivekeeper.gui.services.node import NodeLaunch
from hivekeeper.gui.settings import SettingsStore
from hivekeeper.planner.errors import InputError


def test_settings_page_saves_the_conditions_and_the_node_gets_them_as_flags(app_window, qtbot, config_dir):
    window = app_window
    window.show_page("Settings")
    page = window.settings_page
    assert page.args_label.text() == "The node never pauses on its own."

    page.idle_spin.setValue(5)
    page.battery_check.setChecked(True)
    page.ram_spin.setValue(2.5)
    page.hours_edit.setText("9-9")
    page.hours_edit.editingFinished.emit()
    assert "the start and the end are the same time" in page.error_label.text()
    assert window.settings.node.serve_hours == ""  # a bad value is not taken

    page.hours_edit.setText("22-7")
    page.hours_edit.editingFinished.emit()
    assert page.error_label.text() == ""
    flags = ("--pause-when-active", "5", "--max-ram-gib", "2.5", "--pause-on-battery", "--serve-hours", "22-7")
    assert window.node.owner_args == flags
    argv = " ".join(NodeLaunch("/m").argv())
    assert argv == " ".join(NodeLaunch("/m", owner_args=flags).argv()).replace(" ".join(flags) + " ", "")
    qtbot.waitUntil(lambda: (config_dir / "settings.json").exists() and
                    json.loads((config_dir / "settings.json").read_text())["node"]["serve_hours"] == "22-7",
                    timeout=5_000)
    saved = json.loads((config_dir / "settings.json").read_text())["node"]
    assert saved["idle_minutes"] == 5 and saved["on_battery"] is True and saved["ram_gib"] == 2.5

    saved["serve_hours"] = "25-3"
    (config_dir / "settings.json").write_text(json.dumps({"node": saved}))
    with pytest.raises(InputError, match="node.serve_hours"):
        SettingsStore(config_dir).load()
