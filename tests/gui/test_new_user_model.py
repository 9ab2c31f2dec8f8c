"""Issue 14 (session 11, a new user's first hour): the app opened on a plan for Llama-3.1-8B ("very slow: 25 minutes
per run, 0.09 tokens/s" on a small machine) while its Chat page chats with the built-in model, the one installed.
Now a new user's Plan page plans the built-in model, on this machine, and Chat uses the same one."""

from __future__ import annotations

from hivekeeper.core.runtime.default_model import DEFAULT_MODEL_ID


def test_a_new_user_plans_the_model_the_app_chats_with(app_window, qtbot):
    window = app_window
    window.show_page("Plan")
    plan = window.plan_page
    qtbot.waitUntil(lambda: plan.result is not None, timeout=120_000)
    assert window.settings.plan.model == DEFAULT_MODEL_ID
    assert "SmolLM2-135M" in plan.headline.text() and "very slow" not in plan.warning_label.text()
    window.show_page("Chat")
    assert window.chat_page.model() == DEFAULT_MODEL_ID
