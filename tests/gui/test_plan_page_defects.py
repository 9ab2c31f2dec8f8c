"""Issue 14 item 10, the Plan page of the real MainWindow: no "100% GPU" placement on a machine without a GPU, the
bottleneck card as tall as its text, the Machine box not truncated, the charts' y axes never below 0."""

from __future__ import annotations

import dataclasses

from PySide6.QtWidgets import QApplication

from hivekeeper.gui.settings import Settings
from hivekeeper.planner.hardware_catalog import get_hardware
from hivekeeper.planner.model_catalog import get_model
from hivekeeper.planner.models import CONTEXT_FIELDS


def _window(make_window, qtbot, hardware: str, model="meta-llama/Meta-Llama-3.1-8B-Instruct", quant="auto"):
    settings = Settings()
    settings.plan.model = model
    settings.plan.hardware = hardware
    settings.plan.quant = quant
    window = make_window(settings)
    window.show_page("Plan")
    plan = window.plan_page
    qtbot.waitUntil(lambda: plan.result is not None, timeout=20_000)
    return window, plan


def test_placement_fields_follow_the_plan_and_have_no_gpu_without_one(make_window, qtbot):
    _, plan = _window(make_window, qtbot, "cpu-generic")
    assert not get_hardware("cpu-generic").has_gpu
    assert plan.weight_spins["gpu"].value() == 0 and plan.cache_spins["gpu"].value() == 0
    assert not plan.weight_spins["gpu"].isEnabled() and not plan.cache_spins["gpu"].isEnabled()
    weights = plan.result.plan.prediction.policy.weights
    assert plan.weight_spins["cpu"].value() == round(100 * weights.cpu)
    assert sum(spin.value() for spin in plan.weight_spins.values()) == 100


def test_the_bottleneck_card_holds_its_whole_text(make_window, qtbot):
    # (bitsandbytes nf4, whose CPU dequantization gave the longest text, is no longer offered on a CPU)
    window, plan = _window(make_window, qtbot, "cpu-generic", model="mistralai/Mixtral-8x7B-v0.1")
    card = plan.bottleneck_card
    assert "disk reads" in card.detail.text() and len(card.detail.text()) > 120  # a long explanation
    QApplication.processEvents()
    qtbot.waitUntil(lambda: card.height() >= card.heightForWidth(card.width()), timeout=5_000)
    detail = card.detail
    assert detail.wordWrap() and detail.geometry().bottom() <= card.contentsRect().bottom()
    assert detail.height() >= detail.heightForWidth(detail.width())
    window.resize(1000, 800)  # narrower: more lines, a taller card
    qtbot.waitUntil(lambda: card.height() >= card.heightForWidth(card.width()), timeout=5_000)


def test_the_machine_box_is_not_truncated(make_window, qtbot):
    window, plan = _window(make_window, qtbot, "rtx-4090")
    spec = dataclasses.replace(get_hardware("cpu-generic"), id="detected")

    class Machine:  # the two fields set_machine reads of a MachineInfo
        hardware, efficiency = spec, None

    plan.set_machine(Machine())
    combo = plan.hardware_combo
    metrics = combo.fontMetrics()
    for index in range(combo.count()):
        if combo.itemData(index) == "detected":
            assert metrics.horizontalAdvance(combo.itemText(index)) < combo.width() - 20
    catalog = get_hardware("rtx-4090")  # the label names the machine chosen, not this one
    assert f"{catalog.cpu.memory_bytes / 1e9:.0f} GB RAM" in plan.machine_label.text()
    assert catalog.gpus[0].name in plan.machine_label.text()
    combo.setCurrentIndex(combo.findData("detected"))
    qtbot.waitUntil(lambda: plan.result is not None and plan.result.plan.hardware == "detected", timeout=20_000)
    assert plan.machine_label.text() == f"no GPU, {spec.cpu.memory_bytes / 1e9:.0f} GB RAM"
    assert plan.machine_label.wordWrap()
    assert "RAM" in plan.headroom_label.text() and "kept free" in plan.headroom_label.text()


def test_chart_y_axes_stay_at_or_above_zero(make_window, qtbot):
    _, plan = _window(make_window, qtbot, "rtx-4090")
    qtbot.waitUntil(lambda: plan.charts is not None, timeout=30_000)
    for plot in (plan.budget_plot, plan.batch_plot):
        plot.plotItem.vb.autoRange()
        assert plot.plotItem.vb.viewRange()[1][0] >= 0


def test_a_context_beyond_the_models_own_is_an_error_not_a_plan(make_window, qtbot):
    """Session 23: a Context length of 1,000,000 for an 8192-token model showed 37 tokens/s with 75% of the cache on
    disk; the page now says the model cannot attend that far, and plans again once the context is back in range."""
    _, plan = _window(make_window, qtbot, "cpu-generic", model="TinyLlama/TinyLlama-1.1B-Chat-v1.0")
    limit = get_model("TinyLlama/TinyLlama-1.1B-Chat-v1.0").max_position_embeddings
    plan.context_spin.setValue(1_000_000)
    qtbot.waitUntil(lambda: plan.error_label.isVisible(), timeout=20_000)
    assert plan.error == (f"a context of 1,000,000 tokens (prompt + output, or the context asked for) is beyond "
                          f"TinyLlama/TinyLlama-1.1B-Chat-v1.0's {limit:,} ({CONTEXT_FIELDS})")
    plan.context_spin.setValue(limit)
    qtbot.waitUntil(lambda: not plan.error_label.isVisible(), timeout=20_000)
    assert plan.result.plan.workload.cache_len == limit
