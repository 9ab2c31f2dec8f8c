"""Issue 14 (session 11, a new user's first hour): the Plan page's "fits here" line for the built-in model on a CPU
was cut after its third line ("... KV cache 100% RAM;" and nothing more): it repeated the bottleneck's whole
explanation, which the Bottleneck card beside it shows. Now it says where things go, and is as tall as its text.
The window as `hivekeeper app` opens it, from saved settings (a CPU machine of the catalog)."""

from __future__ import annotations

import pytest

from hivekeeper.gui.settings import Settings, SettingsStore

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("hardware, model", [("cpu-generic", ""), ("cpu-generic", "mistralai/Mixtral-8x7B-v0.1")])
def test_the_fit_line_is_whole_and_leaves_the_bottleneck_to_its_card(hardware, model, qapp, qtbot, config_dir):
    from hivekeeper.gui.app import open_window

    saved = Settings()
    saved.plan.hardware, saved.page = hardware, 1  # the Plan page, the built-in model (the default) or `model`
    saved.plan.model = model or saved.plan.model
    SettingsStore().save(saved)
    window = open_window(qapp)
    qtbot.addWidget(window)
    try:
        window.resize(window.minimumSize())  # the narrowest window: the most lines
        page = window.plan_page
        qtbot.waitUntil(lambda: page.result is not None and page.fit_label.text() != "", timeout=60_000)
        qtbot.wait(100)
        label, plan = page.fit_label, page.result.plan
        assert ("RAM" in label.text() or "GPU" in label.text()) if plan.fit == "local" else "swarm" in label.text()
        if plan.prediction is not None:
            detail = plan.prediction.bottleneck_detail
            assert detail in plan.reason and detail not in label.text()  # said once, in the Bottleneck card
            assert detail in page.bottleneck_card.detail.text()
        assert label.heightForWidth(label.width()) <= label.height(), label.text()  # not clipped
        assert label.toolTip() == plan.reason
    finally:
        window.quit_everything()
