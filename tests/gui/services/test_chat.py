"""The Chat page with the demo model on this machine: tokens stream, Stop works, conversations come back."""

from __future__ import annotations

import json
import threading

from hivekeeper.gui.settings import Settings, SettingsStore


def _settings(model) -> Settings:
    settings = Settings()
    settings.plan.hardware = "cpu-generic"
    settings.chat.model = str(model)
    settings.chat.mode = "local"
    settings.chat.temperature = 0.0  # greedy: the demo model rambles on without an end-of-sequence token
    settings.chat.max_new_tokens = 1500
    settings.chat.system_prompt = "You are terse."
    return settings


def test_chat_streams_stops_and_survives_a_restart(make_window, qtbot, demo_checkpoint, config_dir):
    window = make_window(_settings(demo_checkpoint))
    page = window.chat_page
    window.show_page("Chat")
    pieces, threads = [], set()
    window.chat.yielded.connect(lambda text: (pieces.append(text), threads.add(threading.get_ident())))

    page.input.setPlainText("Tell me a long story about bees.")
    page.send_button.click()
    assert page.replying and not page.send_button.isEnabled() and page.stop_button.isEnabled()
    # the question is on disk before any token: a crash now loses only the reply
    saved = json.loads((config_dir / "conversations" / f"{page.conversation.id}.json").read_text())
    assert saved["messages"] == [{"role": "user", "content": "Tell me a long story about bees."}]
    assert saved["system_prompt"] == "You are terse."

    qtbot.waitUntil(lambda: len(pieces) >= 8, timeout=120_000)  # streaming, token by token
    assert threads == {threading.get_ident()}  # delivered on the GUI thread
    streamed = "".join(pieces)
    assert page.reply_text.startswith(streamed[:20])
    # the transcript redraws on a short timer (not per token), so give it that long to show the reply
    qtbot.waitUntil(lambda: streamed[:20] in page.transcript_text(), timeout=5_000)
    page.stop_button.click()
    qtbot.waitUntil(lambda: not page.replying, timeout=30_000)
    stats = page.last_stats
    assert stats["finish_reason"] == "stopped" and 8 <= stats["new_tokens"] < 1500
    assert stats["tokens_per_s"] > 0
    first_reply = page.conversation.history.messages[-1]
    assert first_reply["role"] == "assistant" and first_reply["content"] == "".join(pieces)
    assert "(stopped)" in page.transcript_text() and "tokens/s" in page.transcript_text()
    assert page.send_button.isEnabled() and not page.stop_button.isEnabled()

    # a second, short reply ends on its own; both replies keep their speed
    page.max_tokens_spin.setValue(12)
    page.input.setPlainText("And then?")
    page.send_button.click()
    qtbot.waitUntil(lambda: not page.replying, timeout=120_000)
    assert page.last_stats["finish_reason"] in ("length", "eos") and page.last_stats["new_tokens"] <= 12
    conversation_id = page.conversation.id
    assert sorted(page.conversation.reply_stats) == [1, 3]
    assert len(window.monitor_page.buffers["chat_tps"]) == 2  # the monitor got both replies
    transcript = page.transcript_text()
    window.shutdown()

    # a new window (the app started again) opens the same conversation, speeds included
    again = make_window(SettingsStore(config_dir).load())
    page2 = again.chat_page
    assert page2.conversation is not None and page2.conversation.id == conversation_id
    messages = page2.conversation.history.messages
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[1]["content"] == first_reply["content"] and messages[2]["content"] == "And then?"
    assert page2.conversation.reply_stats[1]["finish_reason"] == "stopped"
    assert page2.transcript_text() == transcript
    assert page2.list.count() == 1 and page2.list.item(0).text().startswith("Tell me a long story")
    assert page2.max_tokens_spin.value() == 12 and page2.system_edit.toPlainText() == "You are terse."


def test_chat_errors_are_shown_and_the_question_is_kept(make_window, qtbot, tmp_path):
    window = make_window(_settings(tmp_path / "missing-model"))
    page = window.chat_page
    page.input.setPlainText("hello?")
    page.send()
    qtbot.waitUntil(lambda: not page.replying, timeout=120_000)
    assert "missing-model" in page.last_error and "missing-model" in page.transcript_text()
    assert [m["role"] for m in page.conversation.history.messages] == ["user"]
    assert page.send_button.isEnabled()
