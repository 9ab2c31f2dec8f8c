"""Review (issue 14, a new user's pass): the Hardware page's "fixed cost of a block in a decode step" is a fit to two
kinds of decode step, not a timing. Where the fit falls below the steps' noise the page says "not measured" (it
showed "0 ms, spread 0%": the clamp and a constant), and a fit that holds shows the spread of its repeats' fits
(measure.block_overhead), not a constant. The profile is saved as `hivekeeper measure` saves it, from timings
through the measurement's own fit; the page reads it on "Detect again", as a user's click."""

from __future__ import annotations

from PySide6.QtCore import Qt

from hivekeeper.planner.hardware_catalog import get_hardware

from hivekeeper.core.machine.measure import block_overhead, fit_bytes_and_blocks
from hivekeeper.core.machine.measurement import Measurement
from hivekeeper.core.machine.profiles import MachineProfile, comparison_rows, new_profile, save_profile
from hivekeeper.gui.pages.hardware import comparison_cells

QUANTITY = "fixed cost of a block in a decode step"
MIB = 1 << 20
MACHINE = get_hardware("cpu-generic")


def _measured(wide: list[float], narrow: list[float]):
    """The block cost as measure_decode_blocks saves it, for spans of 8 and 30 blocks of 256 MiB each."""
    runs = (wide, 256 * MIB, 8), (narrow, 256 * MIB, 30)
    per_block, _ = fit_bytes_and_blocks(*((min(s), b, n) for s, b, n in runs))
    return block_overhead(per_block, *runs, load=1.0, detail="fitted to the two spans (test timings)")


def _row(window, qtbot, measurement) -> list[str]:
    """The page's cells for the block cost after saving `measurement` in this machine's profile."""
    page = window.hardware_page
    qtbot.waitUntil(lambda: page.machine is not None and page.detect_button.isEnabled(), timeout=60_000)
    profile = new_profile(page.machine.detected)
    profile.measurements = [measurement]
    save_profile(profile)
    before = page.machine
    qtbot.mouseClick(page.detect_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: page.machine is not before and page.compare_table.rowCount() == 1, timeout=60_000)
    table = page.compare_table
    cells = [table.item(0, c).text() for c in range(table.columnCount())]
    assert cells[1] == QUANTITY and measurement.detail in table.item(0, 3).toolTip()
    return cells


def test_a_block_cost_below_the_noise_is_not_measured(app_window, qtbot):
    m = _measured(wide=[0.0300, 0.0310, 0.0335], narrow=[0.0290, 0.0330, 0.0300])  # 30 blocks no slower than 8
    assert m.value == 0 and m.samples[0] < 0 and "does not resolve" in m.detail
    cells = _row(app_window, qtbot, m)
    assert cells[3:] == ["not measured", "", "–"], cells


def test_a_fitted_block_cost_shows_its_value_and_the_spread_of_its_fits():
    m = _measured(wide=[0.0300, 0.0306, 0.0320], narrow=[0.0344, 0.0362, 0.0350])  # 0.2 ms a block, noisy
    assert m.value > 0 and m.spread > 0.01 and len(m.samples) == 3
    row = next(r for r in comparison_rows(MACHINE, MachineProfile("x", {}, 1.0, [m])) if r.quantity == QUANTITY)
    cells = comparison_cells(row, m)
    assert cells[3] == f"{m.value * 1e3:.3g} ms" and cells[5] == f"{100 * m.spread:.0f}%" != "0%", cells
    # a profile saved before the fit's spread was measured held a constant 0: no spread shown, not "0%"
    old = Measurement(m.key, m.label, m.value, "s", 0.0, 3, 1.0, "fitted to the two spans")
    assert comparison_cells(row, old)[3:] == (cells[3], cells[4], "–")
