"""The Hardware page's Measure button as a user clicks it: the window built the way `hivekeeper app` builds it
(gui/app.py: saved settings, detection at start), the services it wires itself, nothing replaced afterwards.
HIVEKEEPER_MEASURE_SIZES=tiny is the app's own switch for sizes of a few megabytes."""

from __future__ import annotations

from PySide6.QtCore import Qt

from hivekeeper.gui.services.measure import SIZES_ENV


def _wait_for_detection(window, qtbot) -> None:
    page = window.hardware_page
    qtbot.waitUntil(lambda: not window.detect.running and page.machine is not None, timeout=180_000)


def test_the_measure_button_measures_this_machine(app_window, qtbot, config_dir, monkeypatch):
    monkeypatch.setenv(SIZES_ENV, "tiny")  # quick's spans exceed the last-level cache: hundreds of MB
    window = app_window
    page = window.hardware_page
    assert window.stack.currentWidget().layout().itemAt(0).widget() is page  # the app opens on this page
    _wait_for_detection(window, qtbot)
    assert page.machine.measured_at is None

    qtbot.mouseClick(page.measure_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: not page.measure_button.isEnabled(), timeout=5_000)  # running: the button waits
    qtbot.waitUntil(lambda: page.machine.measured_at is not None or "failed" in page.profile_label.text(),
                    timeout=180_000)
    assert "failed" not in page.profile_label.text(), page.profile_label.text()
    qtbot.waitUntil(lambda: page.measure_button.isEnabled(), timeout=10_000)
    # the result is on the page: measured numbers in the table, beside the estimates they replaced
    assert "Measured" in page.profile_label.text() and page.progress.value() == 100
    row = next(r for r, values in enumerate(page.rows) if values[:2] == ("RAM", "bandwidth"))
    assert page.table.item(row, 3).text().startswith("measured")
    assert page.machine.hardware.disk.sources["read_bandwidth"].startswith("measured")
    assert not page.compare_table.isHidden() and page.compare_table.rowCount() > 0
    assert (config_dir / "profiles").is_dir()  # saved where `hivekeeper plan --hardware auto` reads it


def test_a_bad_sizes_setting_is_reported_on_the_page(app_window, qtbot, monkeypatch):
    monkeypatch.setenv(SIZES_ENV, "huge")
    window = app_window
    page = window.hardware_page
    _wait_for_detection(window, qtbot)
    qtbot.mouseClick(page.measure_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "failed" in page.profile_label.text(), timeout=120_000)
    text = page.profile_label.text()
    assert SIZES_ENV in text and "'huge'" in text and "quick" in text
    assert page.machine.measured_at is None


def test_the_button_waits_while_another_process_measures_and_cancel_stops_the_wait(app_window, qtbot, config_dir,
                                                                                  monkeypatch):
    """One measurement of a machine at a time across processes (core/machine/profile_files.measuring): while another
    process (here this test) measures, the page says it waits, and Cancel ends the wait without measuring."""
    from hivekeeper.core.machine.profile_files import machine_fingerprint, measuring
    from hivekeeper.gui.services.measure import WAITING_FOR_ANOTHER

    monkeypatch.setenv(SIZES_ENV, "tiny")
    window = app_window
    page = window.hardware_page
    _wait_for_detection(window, qtbot)
    with measuring(machine_fingerprint(page.machine.detected)) as held:
        assert held
        qtbot.mouseClick(page.measure_button, Qt.MouseButton.LeftButton)
        qtbot.waitUntil(lambda: page.progress_label.text() == f"{WAITING_FOR_ANOTHER}…", timeout=60_000)
        qtbot.mouseClick(page.cancel_button, Qt.MouseButton.LeftButton)
        qtbot.waitUntil(lambda: page.measure_button.isEnabled(), timeout=10_000)
    assert page.progress_label.text() == "cancelled" and page.machine.measured_at is None
    assert not list((config_dir / "profiles").glob("*.json"))  # nothing measured, nothing saved
