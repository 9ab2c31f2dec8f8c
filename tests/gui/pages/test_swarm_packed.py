"""Issue 16 item 4, the planning side, in the real window: the Swarm page recommends serving the real default model
(SmolLM2-135M-Instruct, Q4_1) as `hivekeeper serve` loads it, packed: on this machine given RAM for the packed span
but not an fp32 one, "30 blocks, q4_1 packed" (fp32 would hold fewer), and Join starts serve with those 30 blocks
and the flags under which the server keeps them packed (--quant none, --dtype auto: fp32 on the CPU)."""

from __future__ import annotations

import dataclasses

import pytest
from PySide6.QtCore import Qt

from hivekeeper.core.runtime.default_model import DEFAULT_MODEL_ID, default_model_file
from hivekeeper.planner.format_choice import plan_model_server
from hivekeeper.planner.model_catalog import load_model_spec
from hivekeeper.planner.swarm import plan_server


def test_the_swarm_page_recommends_the_packed_span_serve_loads(app_window, qtbot):
    window = app_window
    qtbot.waitUntil(lambda: not window.detect.running and window.hardware_page.machine is not None, timeout=180_000)
    detected = window.hardware_page.machine
    if detected.hardware.has_gpu:
        pytest.skip("a GPU runs a GGUF dequantized: no packed span to recommend")
    path = str(default_model_file())
    roomy = plan_model_server(path, detected.hardware, efficiency=detected.efficiency)
    need = roomy.workspace_bytes + roomy.total_blocks * (roomy.block_bytes + roomy.cache_bytes_per_block)
    hardware = dataclasses.replace(detected.hardware, cpu=dataclasses.replace(detected.hardware.cpu,
                                                                              memory_bytes=int(need + 5e6)))
    fp32 = plan_server(load_model_spec(path), hardware, efficiency=detected.efficiency)
    assert fp32.weight_format == "fp32" and fp32.num_blocks < roomy.total_blocks  # fp32 under-counts

    window.show_page("Swarm")
    page = window.swarm_page
    qtbot.keyClicks(page.model_edit, DEFAULT_MODEL_ID)  # typed, then Enter (editingFinished)
    qtbot.keyClick(page.model_edit, Qt.Key.Key_Return)
    window.detect.detected.emit(dataclasses.replace(detected, hardware=hardware))  # this machine, less RAM
    words = f"{roomy.total_blocks} blocks, q4_1 packed"
    qtbot.waitUntil(lambda: words in page.recommendation_label.text(), timeout=10_000)
    assert page.recommendation.capacity_bytes == hardware.cpu.memory_bytes  # planned for the machine emitted
    assert page.recommendation.num_blocks == roomy.total_blocks > fp32.num_blocks
    launch = page.launch()
    assert (launch.num_blocks, launch.quant, launch.dtype) == (roomy.total_blocks, "none", "auto")
