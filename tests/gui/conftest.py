"""Fixtures for the app's tests: offscreen Qt (pytest-qt), settings in a temporary folder, a tiny demo checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from hivekeeper.gui.settings import Settings, SettingsStore


@pytest.fixture(scope="session")
def demo_checkpoint(tmp_path_factory) -> Path:
    """A tiny random-weight Llama checkpoint (2 blocks, hidden 64) with tokenizer and chat template; read-only."""
    from hivekeeper.core.runtime.demo_model import make_demo_checkpoint

    return make_demo_checkpoint(tmp_path_factory.mktemp("gui-demo") / "tiny-llama")


@pytest.fixture
def config_dir(tmp_path, monkeypatch) -> Path:
    """Settings, caches and conversations of the app go here, never to the user's config folder."""
    folder = tmp_path / "config"
    monkeypatch.setenv("HIVEKEEPER_CONFIG_DIR", str(folder))
    monkeypatch.setenv("HIVEKEEPER_FIRST_MEASURE", "0")  # the app measures a new machine once; tests that want it say so
    return folder


@pytest.fixture
def make_window(qtbot, qapp, config_dir):
    """make_window(settings=None) -> a shown MainWindow on the temporary config folder (no detection at start).
    Every window is shut down at the end of the test (node, watcher and workers stopped)."""
    from hivekeeper.gui.main_window import MainWindow
    from hivekeeper.gui.style import STYLESHEET, configure_pyqtgraph

    qapp.setStyleSheet(STYLESHEET)
    configure_pyqtgraph()
    windows = []

    def make(settings: Settings | None = None, **options) -> MainWindow:
        store = SettingsStore(config_dir)
        window = MainWindow(store, settings, detect_on_start=False, **options)
        window.ask_on_close = lambda: "stop"  # closing with a node running never opens a (blocking) dialog
        qtbot.addWidget(window)
        window.show()
        windows.append(window)
        return window

    yield make
    for window in windows:
        window._quitting = True  # never ask (a dialog would block the test run)
        window.shutdown()


@pytest.fixture
def app_window(qapp, qtbot, config_dir):
    """The main window as `hivekeeper app` opens it (gui/app.py's open_window: saved settings, detection at start),
    without main()'s signal handlers and event loop."""
    from hivekeeper.gui.app import open_window

    window = open_window(qapp)
    qtbot.addWidget(window)
    yield window
    window.quit_everything()  # what the tray's "quit" and SIGTERM do: stop everything, save, close
