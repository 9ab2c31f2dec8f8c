"""`hivekeeper app` closed by SIGTERM while its hardware probe (a child process) still runs: the app kills the probe
and reaps it before it exits, so nothing of it is left, not even a zombie for whoever adopts orphans (this test
process is a subreaper: tests/conftest.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil

from hivekeeper.core.child_argv import hivekeeper_command

from ..child_output import ChildOutput


def _probe_of(app_pid: int) -> psutil.Process | None:
    """The app's hardware-probe child, once it runs."""
    try:
        children = psutil.Process(app_pid).children()
    except psutil.NoSuchProcess:
        return None
    for child in children:
        try:
            if "hivekeeper.gui.services.hardware_probe" in child.cmdline():
                return child
        except psutil.NoSuchProcess:
            continue
    return None


def _left_to_us(pid: int) -> bool:
    """True when the process outlived the app: then it is our child now (alive or a zombie); it is killed and reaped
    here so that later tests start clean."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not our child: the app reaped it
        return False
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
    return True


def test_sigterm_during_detection_stops_and_reaps_the_probe(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    env.update(QT_QPA_PLATFORM="offscreen", HIVEKEEPER_CONFIG_DIR=str(tmp_path / "config"))
    app = ChildOutput(subprocess.Popen(hivekeeper_command("app"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       env=env))
    try:
        deadline = time.monotonic() + 120
        probe = None
        while probe is None and app.proc.poll() is None and time.monotonic() < deadline:
            probe = _probe_of(app.proc.pid)
            time.sleep(0.02)
        assert probe is not None, f"no hardware probe seen{app.report()}"
        app.proc.send_signal(signal.SIGTERM)  # while the probe still works (it imports torch: seconds)
        assert app.wait(timeout=60) == 0, app.report()
    finally:
        app.close()
    assert not _left_to_us(probe.pid), "the probe outlived the app"
    assert _live_descendants() == []


def _live_descendants(wait_s: float = 5.0) -> list:
    """This process's descendants still running once `wait_s` has passed, zombies reaped: a child the killed probe had
    started is adopted here (the suite's subreaper) and showed as a zombie in one run of make test (session 26), an
    ended process, not one that outlived the app."""
    deadline = time.monotonic() + wait_s
    while True:
        live = []
        for child in psutil.Process().children(recursive=True):
            try:
                if child.status() != psutil.STATUS_ZOMBIE:
                    live.append(child)
                elif child.ppid() == os.getpid():
                    os.waitpid(child.pid, os.WNOHANG)
            except (psutil.NoSuchProcess, ChildProcessError):
                pass
        if not live or time.monotonic() > deadline:
            return live
        time.sleep(0.05)
