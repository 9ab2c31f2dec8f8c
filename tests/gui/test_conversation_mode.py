"""Issue 14 item 10, the Chat page of the real MainWindow: a conversation's header shows the run mode (and model) it
used, kept with the conversation, not the mode chosen today; when today's differs, the header says what the next
reply uses."""

from __future__ import annotations

import json

from hivekeeper.gui.settings import Settings, SettingsStore


def _settings(model) -> Settings:
    settings = Settings()
    settings.plan.hardware = "cpu-generic"
    settings.chat.model = str(model)
    settings.chat.mode = "local"
    settings.chat.temperature = 0.0
    settings.chat.max_new_tokens = 4
    return settings


def test_the_header_shows_the_mode_the_conversation_used(make_window, qtbot, demo_checkpoint, config_dir):
    window = make_window(_settings(demo_checkpoint))
    page = window.chat_page
    window.show_page("Chat")
    page.input.setPlainText("Hello")
    page.send_button.click()
    qtbot.waitUntil(lambda: not page.replying, timeout=120_000)
    conversation_id = page.conversation.id
    meta = json.loads((config_dir / "conversations" / f"{conversation_id}.meta.json").read_text())
    assert meta["mode"] == "local" and meta["model"] == str(demo_checkpoint)
    assert page.subtitle.text() == f"{demo_checkpoint.name} · on this machine"

    page.mode_combo.setCurrentIndex(page.mode_combo.findData("swarm"))  # today: the swarm
    assert page.subtitle.text().startswith(f"{demo_checkpoint.name} · on this machine (next reply: ")
    assert "through the swarm" in page.subtitle.text()
    window.save_settings()
    window.shutdown()

    again = make_window(SettingsStore(config_dir).load())  # the app started again, in swarm mode
    page2 = again.chat_page
    again.show_page("Chat")
    assert page2.settings.mode == "swarm"
    page2.open_conversation(conversation_id)
    assert page2.subtitle.text().startswith(f"{demo_checkpoint.name} · on this machine")
    page2.new_conversation()
    assert "on this machine" not in page2.subtitle.text() and "through the swarm" in page2.subtitle.text()
