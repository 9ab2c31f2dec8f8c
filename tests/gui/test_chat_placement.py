"""A local chat in the window as `hivekeeper app` builds it (gui/app.py: saved settings, detection at start): the
model is placed by the planner for the machine the window shows.

First the real machine: the detected hardware reaches the chat, the planner keeps the tiny demo model in RAM, and a
reply streams. Then the window is told of a machine with too little RAM for that model (through the detection
service's own entry point, as a probe answer or a measurement arrives): the next model asked for is planned for
that machine, and the chat says it does not fit instead of loading it.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from hivekeeper.gui.services.hardware_probe import machine_doc
from hivekeeper.gui.settings import Settings, SettingsStore
from hivekeeper.planner.costmodel import Workload
from hivekeeper.planner.hardware_catalog import apply_host_overrides
from hivekeeper.planner.model_catalog import load_model_spec
from hivekeeper.planner.policy import Constraints, search

pytestmark = pytest.mark.slow


@pytest.fixture
def app_window(qapp, qtbot, config_dir, demo_checkpoint):
    """The main window exactly as gui/app.py's main() makes it, from settings saved beforehand (a local chat with
    the demo model, greedy, short replies)."""
    from hivekeeper.gui.app import open_window

    saved = Settings()
    saved.chat.model, saved.chat.mode = str(demo_checkpoint), "local"
    saved.chat.temperature, saved.chat.max_new_tokens = 0.0, 8
    SettingsStore().save(saved)
    window = open_window(qapp)
    qtbot.addWidget(window)
    yield window
    window.quit_everything()


def ask(window, qtbot, question: str) -> None:
    page = window.chat_page
    page.input.setPlainText(question)
    page.send_button.click()
    qtbot.waitUntil(lambda: not page.replying, timeout=120_000)


def test_local_chat_uses_the_plan_for_the_windows_machine(app_window, qtbot, demo_checkpoint, tmp_path):
    window = app_window
    qtbot.waitUntil(lambda: not window.detect.running and window.hardware_page.machine is not None, timeout=180_000)
    machine = window.hardware_page.machine
    spec = load_model_spec(str(demo_checkpoint))
    # the expectation, from the planner: on this machine the demo model's blocks and KV cache stay in RAM
    plan = search(spec, machine.hardware, "chat", Constraints(quant="none"), Workload(512, 512),
                  efficiency=machine.efficiency)
    assert plan.fit == "local" and plan.prediction.policy.weights.cpu == 1.0
    window.show_page("Chat")
    pieces = []
    window.chat.yielded.connect(pieces.append)
    ask(window, qtbot, "Hello there.")
    page = window.chat_page
    assert not page.last_error, page.last_error
    assert "".join(pieces) and page.last_stats["new_tokens"] >= 1
    blocks, cache = window.chat.placement.split("; ")[:2]
    assert blocks.endswith(f"blocks: {spec.num_layers} RAM") and cache == f"KV cache blocks: {spec.num_layers} RAM"

    # a machine whose RAM cannot hold the runtime and this model: the planner finds no local plan, and so must chat
    small = apply_host_overrides(machine.detected, ram_gb=0.5)  # below the runtime reserve (CPU_RUNTIME_BYTES)
    small = dataclasses.replace(small, cpu=dataclasses.replace(small.cpu, in_use_bytes=0))  # as if nothing else ran
    assert search(spec, small, "chat", Constraints(quant="none"), Workload(512, 512)).prediction is None
    window.detect.remember(machine_doc(small, None))
    assert window.chat.hardware.cpu.memory_bytes == small.cpu.memory_bytes
    other = tmp_path / "another-copy"  # another model (a new backend): planned for the machine shown now
    shutil.copytree(demo_checkpoint, other)
    page.model_edit.setText(str(other))
    page.model_edit.editingFinished.emit()
    ask(window, qtbot, "And now?")
    assert "does not fit on this machine" in page.last_error, page.last_error
