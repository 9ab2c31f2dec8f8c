"""The app's chat keeps the conversation's KV cache between replies, and drops it for another conversation."""

from __future__ import annotations

from hivekeeper.core.runtime.chat_history import ChatHistory


def test_replies_reuse_the_kept_cache_until_the_conversation_changes(qtbot, demo_checkpoint):
    from hivekeeper.gui.services.chat_backends import BackendKey, Request
    from hivekeeper.gui.services.chat import ChatService

    service = ChatService()
    errors = []
    service.errored.connect(errors.append)
    key = BackendKey("local", str(demo_checkpoint))
    history = ChatHistory(system_prompt="Be brief.")

    def ask(text: str, conversation: str) -> dict:
        history.add_user(text)
        qtbot.waitUntil(lambda: not service.busy, timeout=30_000)  # the last reply's thread has ended
        request = Request(history=ChatHistory.from_dict(history.to_dict()), max_new_tokens=8, temperature=0.0,
                          top_p=1.0, top_k=0, conversation_id=conversation)
        with qtbot.waitSignal(service.finished, timeout=120_000) as finished:
            service.send(key, request)
        history.add_assistant(finished.args[0]["text"])
        return finished.args[0]

    try:
        first = ask("Hello there", "a")
        second = ask("Tell me more", "a")
        assert first["cached_prompt_tokens"] == 0 and first["prefilled_tokens"] == first["prompt_tokens"]
        assert first["prompt_tokens"] <= second["cached_prompt_tokens"] < second["prompt_tokens"]
        assert second["prefilled_tokens"] == second["prompt_tokens"] - second["cached_prompt_tokens"]
        # the same turns under another conversation: nothing is taken from the previous one's cache
        other = ask("And then?", "b")
        assert other["cached_prompt_tokens"] == 0 and not errors
    finally:
        service.shutdown()
