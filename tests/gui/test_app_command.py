"""`hivekeeper app` as a person runs it: without a display it says so and shows the plan; with one it opens the
window, and SIGTERM (or Ctrl+C) closes it the clean way."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from ..child_output import ChildOutput


def _env(tmp_path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    return {**env, "HIVEKEEPER_CONFIG_DIR": str(tmp_path / "config"), **extra}


def test_without_a_display_it_points_to_the_cli(tmp_path, cli, monkeypatch, measured_machine):
    """In this process (the `cli` fixture): the command's real child process is the test below. The machine was
    measured before (its plan reads the profile; the first plan's measurement is tests/core/cli's)."""
    for name in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HIVEKEEPER_CONFIG_DIR", str(tmp_path / "config"))
    measured_machine(tmp_path / "config")
    out = cli("app", "--model", "Qwen/Qwen2.5-0.5B")
    assert out.returncode == 0, out.stderr
    assert "No display found" in out.stdout and "hivekeeper plan" in out.stdout
    assert "Qwen2.5-0.5B" in out.stdout  # the plan for this machine follows
    assert "measuring it quickly" not in out.stderr  # from the saved profile


def test_the_app_opens_and_closes_cleanly_on_sigterm(tmp_path):
    app = ChildOutput(subprocess.Popen([sys.executable, "-m", "hivekeeper.core.cli.main", "app"],
                                       env=_env(tmp_path, QT_QPA_PLATFORM="offscreen"), stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True))
    try:
        cache = tmp_path / "config" / "machine.json"
        deadline = time.monotonic() + 120
        while not cache.is_file() and app.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # the window is up once it has run its hardware detection
        assert cache.is_file(), "no hardware detection" + app.report()
        app.proc.send_signal(signal.SIGTERM)
        assert app.wait(60) == 0
        assert (tmp_path / "config" / "settings.json").is_file()  # saved on the way out
    finally:
        app.close()
    assert psutil.Process().children(recursive=True) == []
