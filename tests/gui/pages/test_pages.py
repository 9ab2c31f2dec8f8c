"""The window and its pages, offscreen: fast start without torch, every page builds, the plan follows the knobs,
the hardware page shows detection and measurements with their sources."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from hivekeeper.gui.viewmodels import plan_view
from hivekeeper.gui.main_window import PAGES
from hivekeeper.gui.settings import Settings

START_SCRIPT = """
import json, os, sys, time
started = time.perf_counter()
from PySide6.QtWidgets import QApplication
from hivekeeper.gui.main_window import MainWindow
app = QApplication([])
window = MainWindow(detect_on_start=False)
window.show()
app.processEvents()
report = {"seconds": time.perf_counter() - started, "torch": "torch" in sys.modules,
          "hivemind": "hivemind" in sys.modules, "pages_built": sorted(window._built)}
window.build_all_pages()  # ... and every page, built: still none (a page importing core.swarm.dht pulled both)
report["after_all_pages"] = {"torch": "torch" in sys.modules, "hivemind": "hivemind" in sys.modules}
window.shutdown()
print(json.dumps(report))
"""


def test_the_window_starts_without_torch_or_hivemind(tmp_path):
    env = {**os.environ, "HIVEKEEPER_CONFIG_DIR": str(tmp_path), "QT_QPA_PLATFORM": "offscreen"}
    out = subprocess.run([sys.executable, "-c", START_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["torch"] is False and report["hivemind"] is False
    assert report["pages_built"] == ["Hardware"]  # the other pages are built after the first paint
    assert report["after_all_pages"] == {"torch": False, "hivemind": False}


def _catalog_settings(model="meta-llama/Meta-Llama-3.1-8B-Instruct", hardware="rtx-4090") -> Settings:
    settings = Settings()
    settings.plan.model = model
    settings.plan.hardware = hardware
    return settings


def test_every_page_builds_and_paints(make_window, qtbot):
    window = make_window(_catalog_settings())
    window.build_all_pages()
    for name in PAGES:
        window.show_page(name)
        image = window.grab().toImage()
        assert image.width() == 1280 and image.height() == 800
        page = window.page(name)
        assert page.isVisible(), name
    # the plan page computes on its own once shown
    plan = window.plan_page
    qtbot.waitUntil(lambda: plan.result is not None, timeout=10_000)
    assert "Meta-Llama-3.1-8B-Instruct" in plan.headline.text()


def test_changing_a_knob_updates_the_prediction(make_window, qtbot):
    window = make_window(_catalog_settings())
    plan = window.plan_page
    window.show_page("Plan")
    qtbot.waitUntil(lambda: plan.result is not None and plan.charts is not None, timeout=15_000)
    before = plan.decode_card.value.text(), plan.result.numbers["decode_tokens_per_s"]
    bars_before = [b.kv_cache for b in plan.memory_bars.bars]
    count = plan.recomputes

    plan.batch_spin.setValue(16)  # a knob: 16 sequences together
    qtbot.waitUntil(lambda: plan.recomputes > count, timeout=5_000)
    assert plan.result.plan.prediction.policy.batch_size == 16
    assert plan.result.numbers["decode_tokens_per_s"] != before[1]
    assert plan.decode_card.value.text() != before[0]
    assert [b.kv_cache for b in plan.memory_bars.bars] != bars_before  # 16 sequences hold more KV cache
    # the chart marks the current choice once the worker is done
    qtbot.waitUntil(lambda: plan.charts.batch.current_x == 16, timeout=15_000)
    x, y = plan.batch_mark.xData, plan.batch_mark.yData  # as given (getData would be log10 of x)
    assert list(x) == [16] and np.isclose(y[0], plan.result.plan.prediction.throughput_tokens_per_s)

    # leaving memory free on the GPU changes the plan too, and the budget chart marks the new budget
    count = plan.recomputes
    plan.reserve_spins["gpu"].setValue(20.0)
    qtbot.waitUntil(lambda: plan.recomputes > count, timeout=5_000)
    _, total = plan_view.accelerator_memory(plan.hardware())
    gpu_bar = next(b for b in plan.memory_bars.bars if b.tier == "gpu")
    assert gpu_bar.capacity == pytest.approx(total - 20e9, abs=1e6)
    qtbot.waitUntil(lambda: plan.charts.budget.current_x == pytest.approx((total - 20e9) / 1e9), timeout=15_000)

    # an impossible knob is reported in words, not by a crash
    plan.context_spin.setValue(100)  # shorter than prompt + output
    qtbot.waitUntil(lambda: plan.error != "", timeout=5_000)
    assert "context" in plan.error_label.text()
    # the settings follow the knobs and are saved
    window.save_settings()
    saved = window.store.load()
    assert saved.plan.batch_size == 16 and saved.plan.reserve_gb["gpu"] == 20.0


def test_placement_override_and_goals(make_window, qtbot):
    window = make_window(_catalog_settings())
    plan = window.plan_page
    qtbot.waitUntil(lambda: plan.result is not None, timeout=10_000)
    fast = plan.result.numbers["decode_tokens_per_s"]
    plan.override_check.setChecked(True)  # starts from the recommendation: 100% GPU
    qtbot.waitUntil(lambda: plan.result.overridden, timeout=5_000)
    assert plan.result.numbers["decode_tokens_per_s"] == fast
    plan.weight_spins["gpu"].setValue(50)
    plan.weight_spins["cpu"].setValue(50)
    qtbot.waitUntil(lambda: plan.result.plan.prediction.policy.weights.gpu == 0.5, timeout=5_000)
    assert plan.result.numbers["decode_tokens_per_s"] < fast / 2  # half the weights now cross the PCIe link
    assert "host→GPU link" in plan.bottleneck_card.detail.text()
    ram = next(b for b in plan.memory_bars.bars if b.tier == "cpu")
    assert ram.weights > 1e9
    plan.override_check.setChecked(False)
    plan.goal_combo.setCurrentIndex(plan.goal_combo.findData("serve"))
    qtbot.waitUntil(lambda: plan.result.plan.goal == "serve" and not plan.result.overridden, timeout=5_000)
    assert "serves" in plan.decode_card.detail.text()


def test_model_list_shows_the_three_state_fit(make_window, qtbot, demo_checkpoint):
    window = make_window(_catalog_settings(hardware="rtx-3060-12gb"))
    plan = window.plan_page
    qtbot.waitUntil(lambda: plan.fit_of("meta-llama/Meta-Llama-3.1-405B-Instruct") is not None, timeout=20_000)
    assert plan.fit_of("Qwen/Qwen2.5-0.5B").words == "fits here"
    assert plan.fit_of("meta-llama/Meta-Llama-3.1-405B-Instruct").fit in ("swarm", "none")
    item = next(plan.model_list.item(i) for i in range(plan.model_list.count())
                if plan.model_list.item(i).data(256) == "Qwen/Qwen2.5-0.5B")
    assert item.text().startswith("✓") and "fits here:" in item.toolTip()  # mark in the list, why on hover
    big = next(plan.model_list.item(i) for i in range(plan.model_list.count())
               if plan.model_list.item(i).data(256) == "meta-llama/Meta-Llama-3.1-405B-Instruct")
    assert big.text()[0] in "☁✗" and ("needs the swarm" in big.toolTip() or "too large" in big.toolTip())
    plan.model_search.setText("qwen 0.5")
    hidden = [plan.model_list.item(i).isHidden() for i in range(plan.model_list.count())]
    assert hidden.count(False) == 1
    # a local folder works as a model, a missing one is explained under the list
    plan.use_model(str(demo_checkpoint))
    qtbot.waitUntil(lambda: plan.result is not None and "tiny-llama" in plan.headline.text(), timeout=10_000)
    plan.use_model(str(demo_checkpoint.parent / "nothing-here"))
    assert "no such file" in plan.model_error.text() and not plan.model_error.isHidden()
    assert "tiny-llama" in plan.settings.model  # the bad choice did not replace the good one


def test_hardware_page_detects_and_measures(make_window, qtbot, config_dir, monkeypatch):
    from hivekeeper.gui.services.measure import SIZES_ENV

    monkeypatch.setenv(SIZES_ENV, "tiny")  # the app's own switch: sizes of a few MB (the wiring is tested here)
    window = make_window()
    page = window.hardware_page
    with qtbot.waitSignal(window.detect.detected, timeout=120_000):
        page.start_detection()
    assert page.table.rowCount() >= 10 and page.machine.measured_at is None
    kinds = {page.table.item(r, 3).text().split(" ")[0] for r in range(page.table.rowCount())}
    assert "detected" in kinds and ({"estimated", "default"} & kinds)
    assert window.detect.cache_path.is_file()  # the next start shows it at once
    assert window.plan_page.detected is not None and window.plan_page.detected_efficiency is None
    assert page.comparison == [] and page.compare_table.isHidden()  # nothing measured yet
    estimated_ram = page.machine.hardware.cpu.memory_bandwidth

    with qtbot.waitSignal(window.detect.detected, timeout=180_000):  # a measurement comes back as a detection
        page.measure_button.click()
    machine = page.machine
    assert machine.measured_at is not None and machine.profile and (config_dir / "profiles").is_dir()
    assert machine.hardware.cpu.sources["memory_bandwidth"].startswith("measured")
    assert machine.hardware.disk.sources["read_bandwidth"].startswith("measured")
    row = next(r for r, values in enumerate(page.rows) if values[:2] == ("RAM", "bandwidth"))
    assert page.table.item(row, 3).text().startswith("measured")
    assert page.rows[row][4] == f"{estimated_ram / 1e9:.3g} GB/s"  # the estimate it replaced, beside it
    assert "measured" in page.profile_label.text() and page.progress.value() == 100
    # the plan for this machine now uses the measured numbers, with fractions of 1 for them
    assert window.plan_page.detected.cpu.memory_bandwidth == machine.hardware.cpu.memory_bandwidth
    assert "measured" in window.plan_page.detected_efficiency.name
    # measured beside catalog, from the saved profile read in this process (without torch)
    ram = next(r for r in page.comparison if (r.part, r.quantity) == ("RAM", "read bandwidth"))
    assert ram.catalog == estimated_ram
    # the RAM row is the read benchmark; the plan's bandwidth is that, raised to the rate whole decode steps read RAM
    # at when they read faster (profiles.ram_bandwidth: a busy machine's plain read can lag behind)
    assert ram.measured == next(m.value for m in page.profile.measurements if m.key == "ram_read")
    assert machine.hardware.cpu.memory_bandwidth >= ram.measured * (1 - 1e-4)  # (JSON rounding)
    assert ram.spread is not None and page.profile is not None and not page.profile.calibrated
    assert not page.compare_table.isHidden() and page.compare_table.rowCount() == len(page.comparison)
    row = page.comparison.index(ram)
    assert page.compare_table.item(row, 3).text() == f"{ram.measured / 1e9:.3g} GB/s"
    # the plan names its factors: measured fractions, not calibrated
    qtbot.waitUntil(lambda: "measured:cpu" in window.plan_page.factors_label.text(), timeout=20_000)
    assert "not calibrated" in window.plan_page.factors_label.text()
    assert window.chat.hardware is machine.hardware
    # a new window (the app started again) finds the measured machine in the cache at once
    again = make_window()
    assert again.hardware_page.machine.measured_at == machine.measured_at


def test_monitor_plots_node_and_chat_samples_and_pauses(make_window, qtbot):
    window = make_window()
    window.show_page("Monitor")
    monitor = window.monitor_page
    now = time.time()
    for i, served in enumerate((10, 30, 70)):  # three stats lines of a node, one second apart
        window.node.statusReceived.emit({"state": "stats", "time": now - 3 + i, "requests_served": served,
                                         "sessions": 1, "blocks": [0, 4], "inference_rps": 40.0})
    monitor.record_chat_reply(12.5, 80.0)
    assert list(monitor.buffers["node_rps"].arrays()[1]) == [20.0, 40.0]  # from the requests_served differences
    assert monitor.buffers["node_latency_ms"].last() == 100.0  # 4 blocks at 40 per second
    qtbot.waitUntil(lambda: len(monitor.buffers["cpu"]) >= 2, timeout=5_000)  # the 2 Hz system sampler
    count = monitor.redraws
    qtbot.waitUntil(lambda: monitor.redraws > count, timeout=2_000)
    assert list(monitor.curves["chat_tps"].yData) == [12.5]
    assert list(monitor.curves["node_requests"].yData) == [10.0, 30.0, 70.0]

    monitor.pause_button.click()  # paused: buffers fill, plots stand still
    assert monitor.paused and monitor.pause_button.text() == "Resume"
    frozen = monitor.redraws
    monitor.record_chat_reply(20.0, 50.0)
    qtbot.wait(600)
    assert monitor.redraws == frozen and list(monitor.curves["chat_tps"].yData) == [12.5]
    monitor.pause_button.click()
    y = list(monitor.curves["chat_tps"].yData)  # resuming redraws at once; replies are not joined (a NaN between)
    assert y[0] == 12.5 and np.isnan(y[1]) and y[2] == 20.0 and len(y) == 3
