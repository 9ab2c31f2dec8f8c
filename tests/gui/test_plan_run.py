"""Issue 22 item 4 in the real window: the Plan page's "Run this plan" runs a batch generation over a prompts file
with the policy the page shows (on a worker), draws the measured throughput beside the predicted one step by step,
and Stop ends a run early. On the tiny demo checkpoint, planned for a catalog CPU machine (no detection wait)."""

from __future__ import annotations

import pytest
from PySide6.QtCore import Qt

from hivekeeper.planner.model_catalog import load_model_spec

from hivekeeper.core.runtime.tokenizer import load_tokenizer
from hivekeeper.gui.viewmodels import plan_view

PROMPTS = ["The old mill stood by the river", "The new mill stood by the river", "The old barn stood by the river"]
NEW_TOKENS = 4


@pytest.fixture
def plan_page(app_window, qtbot, demo_checkpoint):
    """The Plan page planning the demo checkpoint for the catalog machine cpu-generic (batch goal)."""
    page = app_window.plan_page
    app_window.show_page("Plan")
    page.hardware_combo.setCurrentIndex(page.hardware_combo.findData("cpu-generic"))
    page.goal_combo.setCurrentIndex(page.goal_combo.findData("batch"))
    page.use_model(str(demo_checkpoint))
    qtbot.waitUntil(lambda: page.result is not None and page.settings.model == str(demo_checkpoint)
                    and page.result.plan.prediction is not None, timeout=30_000)
    return page


def room(model) -> int:
    """The most tokens a run of PROMPTS can generate: the model's context less the prompt."""
    from hivekeeper.core.runtime.checkpoint import load_config
    from hivekeeper.core.runtime.generation import context_limit

    return context_limit(load_config(model)) - len(load_tokenizer(model).encode(PROMPTS[0]))


def alone(run, prompt: str, folder) -> str:
    """`run` (the page's BatchRun) on one prompt by itself: its greedy text."""
    import dataclasses

    from hivekeeper.core.offload.batch_run import run_batch

    one = folder / f"alone-{abs(hash(prompt))}.txt"
    one.write_text(prompt + "\n")
    return run_batch(dataclasses.replace(run, prompts_file=str(one)), on_step=lambda step: None)["texts"][0]


def test_run_this_plan_draws_measured_against_predicted_and_stops(plan_page, qtbot, tmp_path, demo_checkpoint):
    box = plan_page.run_box
    assert box.plot.note.isVisible() and "No measurement for cpu-generic" in box.plot.note.text()  # not bare axes
    qtbot.mouseClick(box.run_button, Qt.MouseButton.LeftButton)  # no prompts file yet: says so, starts nothing
    assert "choose a prompts file" in box.status.text() and not box.service.busy

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    box.prompts_edit.setText(str(prompts))
    box.tokens_spin.setValue(NEW_TOKENS)
    qtbot.mouseClick(box.run_button, Qt.MouseButton.LeftButton)
    assert not box.run_button.isEnabled() and box.stop_button.isEnabled()
    qtbot.waitUntil(lambda: box.report is not None or bool(box.error), timeout=60_000)
    assert not box.error
    report = box.report
    # predicted for the run's shape: 3 prompts of their length, NEW_TOKENS each, with the page's policy
    prompt_len = len(load_tokenizer(demo_checkpoint).encode(PROMPTS[0]))
    predicted = plan_view.predict_run(load_model_spec(str(demo_checkpoint)), plan_page.hardware(),
                                      plan_page.settings, plan_page.result.plan.prediction.policy,
                                      plan_page.efficiency(), 3, prompt_len, NEW_TOKENS).throughput_tokens_per_s
    assert report["batch"] == 3 and report["new_tokens"] == 3 * NEW_TOKENS and not report["stopped"]
    assert report["predicted"]["throughput_tokens_per_s"] == pytest.approx(predicted, rel=1e-3)
    # one point a step, tokens/s so far; the predicted line spans them
    assert len(box.points) == NEW_TOKENS and all(rate > 0 for _, rate in box.points)
    assert not box.plot.note.isVisible() and box.plot.getAxis("bottom").isVisible()  # the note gave way to data
    xs, ys = box.measured_curve.getData()
    assert list(ys) == pytest.approx([rate for _, rate in box.points])
    px, py = box.predicted_curve.getData()
    assert list(py) == pytest.approx([predicted, predicted]) and px[-1] == pytest.approx(xs[-1])
    assert "tokens/s measured against" in box.status.text() and "× the prediction" in box.status.text()
    qtbot.waitUntil(lambda: box.run_button.isEnabled())
    # each prompt's text in the batch is its own greedy text, as `hivekeeper generate --prompts-file` gives
    run = plan_page.run_box.last_run
    assert report["texts"] == [alone(run, prompt, tmp_path) for prompt in PROMPTS] and len(set(report["texts"])) > 1

    # Stop ends a run after the step in progress
    box.tokens_spin.setValue(100_000)  # the model's context caps it; Stop comes long before
    assert box.run()
    qtbot.waitUntil(lambda: len(box.points) >= 2 or bool(box.error), timeout=60_000)
    qtbot.mouseClick(box.stop_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: not box.service.busy and box.run_button.isEnabled(), timeout=30_000)
    assert not box.error and box.report["stopped"] and box.status.text().startswith("stopped:")
    assert box.report["steps"] < room(demo_checkpoint) and box.report["new_tokens"] == 3 * box.report["steps"]
