"""Issue 14 item 7 in the app's Plan page (the real MainWindow): the runtime card says whether it is one query or
the whole batch, energy and cost say "per query", a plan that streams most of the model from disk says so instead
of "fits here", and the plan's warnings are on the page."""

from __future__ import annotations

from hivekeeper.gui.settings import Settings
from hivekeeper.gui.viewmodels import plan_view


def _settings(goal: str, hardware: str) -> Settings:
    settings = Settings()
    settings.plan.model = "meta-llama/Meta-Llama-3.1-8B-Instruct"
    settings.plan.hardware = hardware
    settings.plan.goal = goal
    return settings


def test_batch_numbers_say_what_they_cover_and_disk_streaming_is_named(make_window, qtbot):
    window = make_window(_settings("batch", "t4"))
    plan = window.plan_page
    window.show_page("Plan")
    qtbot.waitUntil(lambda: plan.result is not None, timeout=20_000)
    prediction = plan.result.plan.prediction
    batch = prediction.policy.batch_size
    assert batch > 1
    assert plan.runtime_card.caption.text() == f"runtime of the batch of {batch}"
    assert f"{batch} queries together" in plan.runtime_card.detail.text()
    assert "per query on average" in plan.runtime_card.detail.text()
    assert plan.energy_card.caption.text() == "energy per query" and plan.cost_card.caption.text() == "cost per query"
    if prediction.policy.weights.disk > 0.5:
        assert "fits here" not in plan.fit_label.text() and "streamed from disk" in plan.fit_label.text()
    assert plan.warning_label.isVisible() == bool(plan.result.plan.warnings)
    for warning in plan.result.plan.warnings:
        assert warning in plan.warning_label.text()


def test_a_chat_plan_is_per_query(make_window, qtbot):
    window = make_window(_settings("chat", "rtx-4090"))
    plan = window.plan_page
    window.show_page("Plan")
    qtbot.waitUntil(lambda: plan.result is not None, timeout=20_000)
    assert plan.runtime_card.caption.text() == "runtime per query"
    assert "fits here" in plan.fit_label.text() and not plan.warning_label.isVisible()


def test_fit_words_name_disk_streaming():
    from hivekeeper.planner.hardware_catalog import get_hardware
    from hivekeeper.planner.model_catalog import get_model
    from hivekeeper.planner.policy import Constraints, search

    machine = get_hardware("cpu-generic", ram_gb=8)
    result = search(get_model("meta-llama/Meta-Llama-3.1-8B-Instruct"), machine, "batch", Constraints())
    disk = result.prediction.policy.weights.disk
    assert result.fit == "local" and disk > 0.5
    assert plan_view.fit_words(result) == f"runs here, {100 * disk:.0f}% streamed from disk"


def test_the_format_line_names_the_formats_weighed(make_window, qtbot):
    """As `plan`'s format row: the formats the search weighed and did not choose, each its best plan's tokens/s, so a
    choice against a rule of thumb (a newcomer, session 22: bf16 on a CPU where fp32 would stream from disk) shows
    why. On a T4 a chat plan weighs fp16, int8 and nf4."""
    window = make_window(_settings("chat", "t4"))
    plan = window.plan_page
    window.show_page("Plan")
    qtbot.waitUntil(lambda: plan.result is not None, timeout=20_000)
    others = plan.result.numbers["other_formats"]
    chosen = plan.result.numbers["policy"]["weight_format"]
    assert {o["weight_format"] for o in others} == {"fp16", "int8", "nf4"} - {chosen}
    text = plan.format_label.text()
    assert "; weighed: " in text and all(f"{o['weight_format']} {o['decode_tokens_per_s']:.3g} tokens/s" in text
                                         for o in others), text
