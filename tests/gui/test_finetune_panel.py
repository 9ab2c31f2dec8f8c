"""Issue 21 item 4 in the real window: the Chat page's "Fine-tune…" opens the Fine-tune panel, which trains prompts
for the chat's model on a worker with the loss curve drawn step by step; Stop ends a run after the step in progress
(saved), Start resumes it; the prompts saved become the Chat page's trained prompts, and its next backend uses
them. On the tiny demo checkpoint."""

from __future__ import annotations

import json

import pytest
from PySide6.QtCore import Qt

PAIRS = [{"prompt": "The sky is", "completion": " blue."}, {"prompt": "Grass is", "completion": " green."}]


@pytest.fixture
def panel(app_window, qtbot, demo_checkpoint, tmp_path):
    page = app_window.chat_page
    app_window.show_page("Chat")
    page.model_edit.setText(str(demo_checkpoint))
    page.model_edit.editingFinished.emit()
    qtbot.mouseClick(page.finetune_button, Qt.MouseButton.LeftButton)
    panel = page.finetune_panel
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    panel.data_edit.setText(str(data))
    panel.out_edit.setText(str(tmp_path / "tiny.prompts"))
    panel.tokens_spin.setValue(2)
    panel.batch_spin.setValue(2)
    return panel


def test_the_panel_trains_draws_the_loss_stops_resumes_and_feeds_the_chat(app_window, panel, qtbot, tmp_path):
    panel.steps_spin.setValue(3)
    qtbot.mouseClick(panel.start_button, Qt.MouseButton.LeftButton)
    assert not panel.start_button.isEnabled() and panel.stop_button.isEnabled()
    qtbot.waitUntil(lambda: panel.steps_done is not None or bool(panel.error), timeout=120_000)
    assert not panel.error and panel.steps_done == 3
    assert [step for step, _ in panel.losses] == [1, 2, 3]
    xs, ys = panel.curve.getData()
    assert list(xs) == [1, 2, 3] and list(ys) == pytest.approx([loss for _, loss in panel.losses])
    out = str(tmp_path / "tiny.prompts")
    assert app_window.chat_page.prompts_edit.text() == out
    assert app_window.chat_page.backend_key().prompts == out

    # a long run stopped after a step or two is saved there; Start goes on from it
    qtbot.waitUntil(lambda: panel.start_button.isEnabled())
    panel.steps_spin.setValue(10_000)
    assert panel.start()
    qtbot.waitUntil(lambda: len(panel.losses) >= 1 or bool(panel.error), timeout=120_000)
    qtbot.mouseClick(panel.stop_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.start_button.isEnabled(), timeout=120_000)
    assert not panel.error and 4 <= panel.steps_done < 10_000
    stopped_at = panel.steps_done
    panel.steps_spin.setValue(stopped_at + 1)
    panel.tokens_spin.setValue(5)  # for a new file: a resume goes on with the file's 2 (it was refused, session 23)
    panel.method_combo.setCurrentIndex(panel.method_combo.findData("ptune"))
    assert panel.start()
    qtbot.waitUntil(lambda: panel.start_button.isEnabled() and panel.steps_done is not None, timeout=120_000)
    assert not panel.error and [step for step, _ in panel.losses] == [stopped_at + 1]
    assert panel.steps_done == stopped_at + 1


def test_the_chat_backend_runs_trained_prompts_first(demo_checkpoint, tmp_path):
    import threading

    import torch

    from hivekeeper.core.finetune.prompts import PromptsInfo, TrainablePrompts, save_prompts
    from hivekeeper.core.runtime.chat_history import ChatHistory
    from hivekeeper.core.runtime.checkpoint import load_config
    from hivekeeper.gui.services.chat_backends import BackendKey, ChatBackend, Request

    config = load_config(demo_checkpoint)
    prompts = TrainablePrompts("deep_ptune", 2, config.hidden_size, config.num_layers)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        prompts.input.normal_(0, 1.0, generator=generator)
        prompts.deep.normal_(0, 1.0, generator=generator)
    out = tmp_path / "p.prompts"
    save_prompts(out, prompts, PromptsInfo("tiny", "deep_ptune", 2, config.hidden_size, config.num_layers))
    history = ChatHistory()
    history.add_user("hello there")
    request = Request(history, max_new_tokens=6, temperature=0.0, top_p=1.0, top_k=0)
    texts = []
    for key in (BackendKey("local", str(demo_checkpoint)), BackendKey("local", str(demo_checkpoint), prompts=str(out))):
        backend = ChatBackend(key, None, lambda words: None)
        try:
            texts.append(backend.reply(request, lambda text: None, threading.Event()).texts[0])
            placement = backend.placement
        finally:
            backend.close()
    assert "trained prompts" in placement and str(out) in placement
    assert texts[0] != texts[1]
