"""Issue 14 (session 11): the Hardware page showed "peak compute 0.0147 bf16, ... TFLOP/s" beside "bf16 matmul 389
GFLOP/s measured", and "8.19 int8 TFLOP/s" for a 2-core VM. Those were the rate the planner charges bf16 matmuls on a
CPU whose 16-bit plans compute in fp32 (1/7 of the measured fp32 rate), and the theoretical AMX peak of the CPU's
flags, both in one line in TFLOP/s. Now each dtype has its own row, in its own unit, saying what kind of number it
is. Through the real window: the CPU's flags pinned to a Sapphire Rapids' (AMX) before the app starts and detects,
then a profile with measured matmuls saved as `hivekeeper measure` saves it, and "Detect again"."""

from __future__ import annotations

import pytest
from PySide6.QtCore import Qt

from hivekeeper.planner.hardware_catalog import get_hardware

from hivekeeper.core.machine.measurement import PREFILL_FLOPS_KEY, Measurement
from hivekeeper.core.machine.profiles import new_profile, save_profile

AMX = "sse2 avx avx2 fma avx512f avx512bw avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8"


@pytest.fixture
def amx(cpu_flags):
    """The CPU's flags, pinned before the app starts (and detects this machine): requested before app_window."""
    cpu_flags(AMX)


def _compute_rows(page) -> dict[str, tuple[str, str, int]]:
    """The CPU's compute rows as {quantity: (value, source, table row)}."""
    assert not any(quantity == "peak compute" for _, quantity, *_ in page.rows)
    return {quantity: (value, source, r) for r, (part, quantity, value, source, _) in enumerate(page.rows)
            if part.startswith("CPU") and quantity.endswith(" compute")}


def _detect_again(page, qtbot) -> dict[str, tuple[str, str, int]]:
    """Click "Detect again"; the CPU's compute rows as {quantity: (value, source, table row)}."""
    before = page.machine
    qtbot.mouseClick(page.detect_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: page.machine is not before and page.detect_button.isEnabled(), timeout=120_000)
    return _compute_rows(page)


def _matmul(dtype: str, flops: float) -> Measurement:
    return Measurement(f"cpu_matmul_{dtype}_prefill", f"{dtype} matmul", flops, "FLOP/s", 0.02, 3, 1.0,
                       "[256, 1024] x [1024, 1024] (test figures)")


def test_each_compute_figure_has_its_unit_and_says_what_kind_of_number_it_is(amx, app_window, qtbot):
    page = app_window.hardware_page
    qtbot.waitUntil(lambda: page.machine is not None and page.detect_button.isEnabled(), timeout=120_000)
    rows = _compute_rows(page)
    assert set(rows) >= {"fp32 compute", "bf16 compute", "int8 compute"}, rows
    int8_value, int8_source, r = rows["int8 compute"]
    assert int8_value.endswith(("GFLOP/s", "TFLOP/s")) and "e+" not in int8_value
    assert int8_source.startswith("estimated: a theoretical peak") and "x the fp32 peak" in int8_source
    assert page.table.item(r, 3).text().startswith("estimated  ·  a theoretical peak")  # on screen
    # native bf16 math: its rate is AMX's (what a batch plan's many-row steps are charged); no measurement says a
    # one-row bf16 step is faster, so plans of up to 8 rows compute in fp32, which the bf16 row says (issue 22)
    assert rows["bf16 compute"][1].startswith("estimated: a theoretical peak") and \
        "CPU 16-bit plans: bf16 beyond 8 rows a step, fp32 up to 8" in rows["bf16 compute"][1]
    assert "CPU 16-bit plans" not in rows["fp32 compute"][1] + int8_source

    profile = new_profile(page.machine.detected)
    # the fp32 rate plans use is the runtime's own prefill passes (measure since session 11), not the fp32 matmul
    prefill = Measurement(PREFILL_FLOPS_KEY, "fp32 prefill through decoder blocks", 80e9, "FLOP/s", 0.1, 5, 1.0,
                          "prefill passes (test figures)")
    profile.measurements = [_matmul("fp32", 100e9), _matmul("bf16", 389e9), prefill]
    save_profile(profile)
    rows = _detect_again(page, qtbot)
    assert set(rows) == {"fp32 compute", "bf16 compute"}  # measured dtypes only: one table, one source
    assert rows["fp32 compute"][0] == "80 GFLOP/s" and rows["fp32 compute"][1].startswith("measured")
    # each figure says what was timed (the fp32 one read "matmul at the prefill shape")
    assert "fp32 80 GFLOP/s (the runtime's prefill passes through decoder blocks)" in rows["fp32 compute"][1]
    value, source, r = rows["bf16 compute"]
    assert value == "389 GFLOP/s"  # what a batch plan's many-row steps are charged: the measured rate itself
    assert source.startswith("measured") and "bf16 389 GFLOP/s (a matmul at the prefill shape)" in source
    assert "CPU 16-bit plans: bf16 beyond 8 rows a step, fp32 up to 8" in source
    assert page.table.item(r, 2).text() == value and page.table.item(r, 3).text().startswith("measured")
    compare = {page.compare_table.item(i, 1).text(): page.compare_table.item(i, 3).text()
               for i in range(page.compare_table.rowCount())}
    assert compare["bf16 matmul"] == "389 GFLOP/s"  # the measured rate itself, below
    # beside it, the estimate it replaced says what that figure is: the bf16 one is not fp32's (the issue: every
    # dtype's catalog cell showed the FLOP/s table's one source, the fp32 peak's "cores x clock x FLOP/cycle")
    catalog = {page.compare_table.item(i, 1).text(): page.compare_table.item(i, 2).toolTip()
               for i in range(page.compare_table.rowCount())}
    assert "x the fp32 peak" in catalog["bf16 matmul"] and "for its bf16 instructions" in catalog["bf16 matmul"]
    assert "CPU 16-bit plans" in catalog["bf16 matmul"] and "CPU 16-bit plans" not in catalog["fp32 matmul"]
    assert catalog["fp32 matmul"].startswith("estimated: a theoretical peak") and "x the fp32 peak" not in \
        catalog["fp32 matmul"]


def test_large_figures_are_written_without_an_exponent():
    """"1.01e+03 GB/s" was an RTX 4090's memory bandwidth on the page; an H100's int8 peak read "1.98e+03 TFLOP/s"."""
    from hivekeeper.gui.pages.hardware import hardware_rows

    values = {quantity: value for _, quantity, value, _ in hardware_rows(get_hardware("h100-sxm"))}
    assert values["memory bandwidth"] == "3,350 GB/s" and values["int8 compute"] == "1,979 TFLOP/s", values


def test_a_bf16_figure_raised_to_the_fp32_rate_says_so_not_fp32s_source(cpu_flags):
    """The issue's other half: on a CPU with native bf16 math whose measured bf16 rate is below fp32's, the planner's
    table raises bf16 to the fp32 rate (cpu_dtype_rule.with_choice), and the bf16 row showed fp32's figure with the
    measurement's source, which reads as fp32's. Now it says the figure is fp32's rate and what bf16's own was; the
    fp32 row keeps the measurement. Without a display: the rows the page and its comparison table are built from."""
    from hivekeeper.gui.pages.hardware import hardware_rows

    from hivekeeper.core.machine.detect import detect_hardware
    from hivekeeper.core.machine.measurement import PREFILL_BF16_KEY
    from hivekeeper.core.machine.profiles import MachineProfile, apply_measurements, comparison_rows

    cpu_flags("sse2 avx avx2 fma avx512f avx512_bf16")  # AVX512-BF16, as the AMD EPYC
    prefill = [Measurement(PREFILL_FLOPS_KEY, "fp32 prefill", 80e9, "FLOP/s", 0.1, 3, 1.0, "test figures"),
               Measurement(PREFILL_BF16_KEY, "bf16 prefill", 60e9, "FLOP/s", 0.1, 3, 1.0, "test figures")]
    detected = detect_hardware()
    sources = {quantity: (value, source) for part, quantity, value, source in
               hardware_rows(apply_measurements(detected, prefill)) if part.startswith("CPU")}
    assert sources["bf16 compute"][0] == sources["fp32 compute"][0] == "80 GFLOP/s"
    assert sources["bf16 compute"][1].startswith("derived: bf16 at the fp32 rate") and \
        "its own 60 GFLOP/s" in sources["bf16 compute"][1]
    assert sources["fp32 compute"][1].startswith("measured") and "bf16 at the fp32 rate" not in \
        sources["fp32 compute"][1]
    rows = {r.quantity: r for r in comparison_rows(detected, MachineProfile("x", {}, 1.7e9, prefill))}
    fp32, bf16 = rows["fp32 prefill through blocks"], rows["bf16 prefill through blocks"]
    assert bf16.catalog == pytest.approx(2 * fp32.catalog, rel=1e-4) and "2x the fp32 peak" in bf16.catalog_source
    assert "2x the fp32 peak" not in fp32.catalog_source
