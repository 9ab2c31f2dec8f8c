"""A machine profile measured busy (a load above the CPU count: its figures can plan the machine several times too
slow) in the real window: once the machine is quiet the app measures it again by itself (quick sizes, on the worker,
the status bar says why); while it is still busy the app keeps it and the status bar says so. HIVEKEEPER_LOAD_AVERAGE
pins the load now, HIVEKEEPER_MEASURE_SIZES=tiny keeps the benchmarks to a few megabytes."""

from __future__ import annotations

import json
import os

import pytest

from hivekeeper.core.machine.measurement import LOAD_ENV
from hivekeeper.core.machine.profiles import load_profile, save_profile
from hivekeeper.gui.services.measure import FIRST_MEASURE_ENV, SIZES_ENV

CPUS = os.cpu_count() or 1
BUSY = CPUS + 2.5


@pytest.fixture
def busy_profile(config_dir, suite_machine_profile):
    """This machine's profile (the suite's fixed figures) as if measured at load BUSY, in the app's config folder,
    written before the window opens and detects."""
    profile = load_profile(suite_machine_profile)
    for measurement in profile.measurements:
        measurement.loadavg = BUSY
    return save_profile(profile)


def _status_seen(window) -> list[str]:
    seen = []
    window.statusBar().messageChanged.connect(seen.append)
    return seen


def test_a_busy_profile_is_measured_again_once_quiet(busy_profile, app_window, qtbot, monkeypatch):
    for name, value in ((SIZES_ENV, "tiny"), (FIRST_MEASURE_ENV, "1"), (LOAD_ENV, "0.4")):
        monkeypatch.setenv(name, value)
    seen = _status_seen(app_window)
    heading = f"Measuring this machine again, quickly (its profile was measured at load {BUSY:.1f})…"
    qtbot.waitUntil(lambda: heading in seen, timeout=180_000)  # after the start-up detection
    qtbot.waitUntil(lambda: any(text.startswith("Measured this machine quickly") for text in seen), timeout=120_000)
    assert any(text.startswith(heading) and text.endswith("%") for text in seen)  # each step, under that heading
    saved = json.loads(busy_profile.read_text())
    assert saved["measured_at"] != 1.7e9 and "fixed by tests/conftest.py" not in json.dumps(saved)  # measured now


def test_a_busy_profile_is_kept_and_said_while_busy(busy_profile, app_window, qtbot, monkeypatch):
    monkeypatch.setenv(FIRST_MEASURE_ENV, "1")
    monkeypatch.setenv(LOAD_ENV, str(CPUS))  # others hold every core: a measurement now would be busy again
    seen = _status_seen(app_window)
    said = (f"This machine's profile was measured busy (load {BUSY:.1f} on {CPUS} CPUs): plans may be too slow; it "
            f"is measured again when the load is at most {CPUS / 2:g}.")
    qtbot.waitUntil(lambda: said in seen, timeout=180_000)
    assert not app_window.measure.running and app_window.first_measure.started_at is None
    assert "fixed by tests/conftest.py" in busy_profile.read_text()  # kept
