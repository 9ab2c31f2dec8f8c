"""`hivekeeper app`: create the Qt application, the main window from saved settings, and run the event loop.

Kept light on purpose: torch and hivemind are not imported here (detection, the node, coverage and chat load them
in child processes or on workers), so the window paints well under 2 s.
"""

from __future__ import annotations

import sys

from hivekeeper.planner.errors import InputError


def broken_bindings() -> str | None:
    """Why the installed Qt bindings cannot run the app, or None. PySide6 6.12.0 on Python < 3.12 drops a reference
    to None (and True/False) on every call of a method that returns nothing, so any session ends in
    "Fatal Python error: none_dealloc" after a few thousand calls."""
    import PySide6

    if PySide6.__version__.startswith("6.12.0") and sys.version_info < (3, 12):
        return (f"PySide6 {PySide6.__version__} crashes on Python {sys.version_info.major}.{sys.version_info.minor} "
                "(it frees None after a few thousand calls); install another version: "
                "pip install 'PySide6-Essentials>=6.6,!=6.12.0'")
    return None


def _quit_on_signals(window) -> None:
    """Ctrl+C or SIGTERM close the app the clean way: the node leaves the swarm, children stop."""
    import signal

    from PySide6.QtCore import QTimer

    def handler(signum, frame) -> None:
        QTimer.singleShot(0, window.quit_everything)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    # Python runs signal handlers only between bytecodes: wake the interpreter now and then inside Qt's loop
    heartbeat = QTimer(window)
    heartbeat.timeout.connect(lambda: None)
    heartbeat.start(250)


def name_application(app) -> None:
    """Names the app for the desktop: its name, version, and the id of its desktop entry (packaging/linux), by which
    Wayland compositors and task bars match the window to the menu entry and its icon."""
    from hivekeeper.core.version import APP_ID, hivekeeper_version

    app.setApplicationName("Hivekeeper")
    app.setOrganizationName("hivekeeper")
    app.setApplicationVersion(hivekeeper_version())
    app.setDesktopFileName(APP_ID)


def open_window(app):
    """The main window from saved settings, styled and shown: what `hivekeeper app` opens (tests build it here too)."""
    from hivekeeper.gui.main_window import MainWindow
    from hivekeeper.gui.settings import SettingsStore
    from hivekeeper.gui.style import STYLESHEET, configure_pyqtgraph

    app.setStyleSheet(STYLESHEET)
    configure_pyqtgraph()
    store = SettingsStore()
    settings, error = store.load_or_default()
    if error:
        print(f"hivekeeper app: settings reset: {error}", file=sys.stderr)
    window = MainWindow(store, settings, settings_error=error)
    window.show()
    return window


def main(argv: list[str] | None = None) -> int:
    """Open the app; returns the event loop's exit code."""
    problem = broken_bindings()
    if problem:
        print(f"hivekeeper app: {problem}", file=sys.stderr)
        return 2
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication([sys.argv[0], *(argv or [])])
    name_application(app)
    # with the tray icon the app keeps running while a node serves in the background
    app.setQuitOnLastWindowClosed(False)
    window = open_window(app)
    window.closed.connect(app.quit)
    _quit_on_signals(window)
    try:
        return int(app.exec())
    except InputError as exc:  # pragma: no cover - the event loop does not raise in practice
        print(f"hivekeeper app: error: {exc}", file=sys.stderr)
        return 2
