"""Issue 14 item 3 in the app: the window built as gui/app.py builds it detects this machine, the Hardware page says
what plans keep free (the default headroom, with what other programs hold), and the Plan page's plans leave it free."""

from __future__ import annotations

import pytest

from hivekeeper.planner.hardware import default_headroom


def test_the_hardware_page_shows_what_plans_keep_free(app_window, qtbot):
    window, page = app_window, app_window.hardware_page
    qtbot.waitUntil(lambda: not window.detect.running and page.machine is not None, timeout=180_000)
    spec = page.spec
    kept = default_headroom(spec)
    rows = {values[0]: values for values in page.rows if values[1] == "kept free"}
    assert set(rows) >= {"RAM", "Disk"}
    assert rows["RAM"][2] == f"{kept['cpu'] / 1e9:.3g} GB"
    assert "other programs held" in rows["RAM"][3] and "10%" in rows["RAM"][3]
    assert spec.cpu.in_use_bytes > 0
    row = next(r for r, values in enumerate(page.rows) if values[:2] == ("RAM", "kept free"))
    assert page.table.item(row, 2).text() == rows["RAM"][2]  # on screen, not only in the model
    assert page.table.item(row, 3).text().startswith("default  ·  headroom: larger of")  # a default, not "catalog"


def test_the_plan_page_plans_with_the_headroom(make_window, qtbot):
    from hivekeeper.gui.settings import Settings
    from hivekeeper.planner.hardware_catalog import get_hardware

    settings = Settings()
    settings.plan.model = "meta-llama/Meta-Llama-3.1-8B-Instruct"
    settings.plan.hardware = "rtx-4090"
    window = make_window(settings)
    plan = window.plan_page
    window.show_page("Plan")
    qtbot.waitUntil(lambda: plan.result is not None, timeout=15_000)
    machine = get_hardware("rtx-4090")
    kept = default_headroom(machine)
    gpu_bar = next(b for b in plan.memory_bars.bars if b.tier == "gpu")
    assert gpu_bar.capacity == pytest.approx(machine.gpus[0].memory_bytes - kept["gpu"], abs=1e6)
    assert kept["gpu"] >= 0.5 * 2**30
