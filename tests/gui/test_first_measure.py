"""Issue 14 item 12 through the real window: the first time the app plans for a machine that was never measured, it
measures it quickly by itself on a worker (never the GUI thread), says so in the status bar, then says what it
found, and the Plan page plans with the measured numbers. HIVEKEEPER_MEASURE_SIZES=tiny (the app's own switch)
keeps the benchmarks to a few megabytes; HIVEKEEPER_FIRST_MEASURE=0 (the other GUI tests' default) turns it off."""

from __future__ import annotations

import threading

from PySide6.QtCore import QPoint

from hivekeeper.gui.services import measure as measure_service
from hivekeeper.gui.services.measure import FIRST_MEASURE_ENV, MEASURING_QUICK, SIZES_ENV


def test_the_app_measures_a_new_machine_quickly_and_says_so(app_window, qtbot, config_dir, monkeypatch):
    monkeypatch.setenv(SIZES_ENV, "tiny")
    monkeypatch.setenv(FIRST_MEASURE_ENV, "1")
    threads = []
    real = measure_service.measure_machine
    monkeypatch.setattr(measure_service, "measure_machine",
                        lambda *args: threads.append(threading.current_thread()) or real(*args))
    window = app_window
    seen = []
    window.statusBar().messageChanged.connect(seen.append)
    qtbot.waitUntil(lambda: MEASURING_QUICK in seen, timeout=180_000)  # after the start-up detection
    qtbot.waitUntil(lambda: any(text.startswith("Measured this machine quickly") for text in seen),
                    timeout=120_000)
    done = next(text for text in seen if text.startswith("Measured this machine quickly"))
    # (a load above the CPU count while measuring says so instead: busy_words, tested in tests/core/machine)
    assert "RAM" in done and "GB/s" in done and ("measured numbers" in done or "measure again when quiet" in done)
    # it says how long it takes and shows each step as it goes (it took 32-47 s at load 10-13: session 11-12)
    steps = [text for text in seen if text.startswith(MEASURING_QUICK) and text.endswith("%")]
    assert any("RAM bandwidth, 0%" in text for text in steps) and any("decode steps" in text for text in steps)
    assert " s)" in MEASURING_QUICK
    bar = window.statusBar()  # whole beside the node's status at 1280 px (its end was cut off: session 11)
    node_left = window.node_status.mapTo(window, QPoint(0, 0)).x()  # the node's status sits at the bar's right
    for text in (done, max(steps, key=len)):
        assert bar.fontMetrics().horizontalAdvance(text) < node_left - bar.mapTo(window, QPoint(0, 0)).x() - 20, text
    assert threads and threads[0] is not threading.main_thread()  # on the worker
    machine = window.hardware_page.machine
    assert machine.measured_at is not None and (config_dir / "profiles").is_dir()
    plan_page = window.plan_page
    qtbot.waitUntil(lambda: plan_page.result is not None and "measured" in plan_page.factors_label.text(),
                    timeout=60_000)
    assert plan_page.detected_efficiency is not None  # the Plan page plans with the measured factors

    # once per machine: a later detection of the measured machine starts nothing
    assert not window.first_measure.maybe_start(machine)
