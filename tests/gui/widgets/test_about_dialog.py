"""Help → About Hivekeeper in the window `hivekeeper app` opens: the box shows Hivekeeper's version (pyproject's, from
the package metadata) and the versions of Python, torch, hivemind, PySide6 and Qt actually installed; and the app
is named for the desktop with its desktop entry's id."""

from __future__ import annotations

import platform
import tomllib
from importlib import metadata
from pathlib import Path

import PySide6
from PySide6.QtCore import qVersion
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QLabel

from hivekeeper.gui.app import name_application

ROOT = Path(__file__).resolve().parents[3]


def pyproject_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def about_action(window):
    help_menu = next(action.menu() for action in window.menuBar().actions() if action.text() == "&Help")
    return next(action for action in help_menu.actions() if action.text() == "&About Hivekeeper")


def close_button(box):
    return box.findChild(QDialogButtonBox).button(QDialogButtonBox.StandardButton.Close)


def test_help_about_shows_the_versions_of_hivekeeper_torch_hivemind_and_qt(app_window, qtbot):
    about_action(app_window).trigger()
    box = app_window.findChild(QDialog, "about")
    qtbot.waitUntil(box.isVisible, timeout=5000)
    assert box.windowTitle() == "About Hivekeeper"
    table = box.findChild(QLabel, "versions")
    assert table.isVisible() and table.width() > 0
    assert f"<b>Hivekeeper {pyproject_version()}</b>" in table.text()
    expected = {"Python": platform.python_version(), "torch": metadata.version("torch"),
                "hivemind": metadata.version("hivemind"), "PySide6": PySide6.__version__, "Qt": qVersion()}
    for name, version in expected.items():
        assert f"<td>{name}</td><td>&nbsp;{version}</td>" in table.text()
    close_button(box).click()
    qtbot.waitUntil(lambda: not box.isVisible(), timeout=5000)
    about_action(app_window).trigger()  # a second time: the same box again
    qtbot.waitUntil(box.isVisible, timeout=5000)
    assert app_window.findChildren(QDialog, "about") == [box]
    close_button(box).click()


def test_the_app_is_named_by_its_desktop_entry(qapp):
    before = (qapp.applicationName(), qapp.organizationName(), qapp.applicationVersion(), qapp.desktopFileName())
    try:
        name_application(qapp)
        entry = ROOT / "packaging" / "linux" / f"{qapp.desktopFileName()}.desktop"
        assert entry.is_file(), f"no desktop entry {entry.name} for the app's desktop file name"
        assert "Exec=hivekeeper app" in entry.read_text()
        assert qapp.applicationVersion() == pyproject_version()
        assert qapp.applicationName() == "Hivekeeper"
    finally:
        qapp.setApplicationName(before[0])
        qapp.setOrganizationName(before[1])
        qapp.setApplicationVersion(before[2])
        qapp.setDesktopFileName(before[3])
