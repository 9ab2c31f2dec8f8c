"""Review (issue 14, a new user's pass): the Plan page's three charts keep their x-axis labels at the app's 1280x800
in the real window, even with a long warning above them: the results column scrolls rather than squeezing the charts
under the window's edge; and "predicted vs measured" (and the Swarm page's coverage, before a node is online) say why
they are empty instead of showing bare 0-1 axes (the coverage's note giving way to bars and back: test_swarm.py)."""

from __future__ import annotations

from PySide6.QtCore import QPoint, Qt
from PySide6.QtWidgets import QApplication

from hivekeeper.gui.pages.plan import CHART_HEIGHT
from hivekeeper.gui.pages.swarm import NO_COVERAGE


def _plan(window, qtbot, model: str, hardware: str):
    """The Plan page showing `model` on the catalog machine `hardware`, picked as a user picks them."""
    window.show_page("Plan")
    plan = window.plan_page
    plan.hardware_combo.setCurrentIndex(plan.hardware_combo.findData(hardware))
    items = [plan.model_list.item(i) for i in range(plan.model_list.count())]
    plan.model_list.setCurrentItem(next(i for i in items if i.data(Qt.ItemDataRole.UserRole) == model))
    qtbot.waitUntil(lambda: plan.result is not None and plan.headline.text().endswith(f"on {hardware}")
                    and model.split("/")[-1] in plan.headline.text(), timeout=20_000)
    QApplication.processEvents()
    return plan


def test_the_charts_keep_their_axis_labels_under_a_long_warning(app_window, qtbot):
    assert (app_window.width(), app_window.height()) == (1280, 800)
    plan = _plan(app_window, qtbot, "mistralai/Mixtral-8x7B-v0.1", "cpu-generic")
    assert plan.warning_label.isVisible() and plan.warning_label.text().count("⚠") == 2  # two long warnings
    for chart in (plan.batch_plot, plan.budget_plot, plan.run_box.plot):
        panel = chart.parentWidget()  # the results column (inside its scroll area)
        top = chart.mapTo(panel, QPoint(0, 0)).y()
        assert chart.height() >= CHART_HEIGHT and top + chart.height() <= panel.height(), (top, chart.height(),
                                                                                          panel.height())
        axis = chart.getAxis("bottom")
        assert axis.isVisible() or chart is plan.run_box.plot
        if axis.isVisible():  # the label below the ticks is drawn inside the chart
            assert axis.label.isVisible() and axis.sceneBoundingRect().bottom() <= chart.height()


def test_empty_charts_say_why_they_are_empty(app_window, qtbot):
    app_window.show_page("Plan")  # on this machine, as the app opens: nothing measured until Run this plan runs
    chart = app_window.plan_page.run_box.plot
    assert chart.note.isVisible() and chart.note.text().startswith("Nothing measured yet: Run this plan runs it")
    plan = _plan(app_window, qtbot, "meta-llama/Meta-Llama-3.1-8B-Instruct", "rtx-4090")
    left, bottom = chart.getAxis("left"), chart.getAxis("bottom")
    assert chart.note.isVisible() and chart.note.text().startswith("No measurement for rtx-4090: it is a catalog")
    assert not left.isVisible() and not bottom.isVisible()  # no bare 0-1 axes
    assert chart.rect().contains(chart.note.geometry()) and plan.run_box.plot is chart
    app_window.show_page("Swarm")
    coverage = app_window.swarm_page.coverage_plot
    assert coverage.note.isVisible() and coverage.note.text() == NO_COVERAGE
    assert not coverage.getAxis("left").isVisible() and not coverage.getAxis("bottom").isVisible()


def test_the_legends_sit_under_the_charts_not_over_the_curves(app_window, qtbot):
    """Issue 14 (session 11): each legend was drawn inside its chart's plotted area, over the curves (the batch
    chart's over its rising throughput, the memory chart's over its flat top). Each now has its own row under the
    x-axis label, whole within the chart's width."""
    plan = _plan(app_window, qtbot, "meta-llama/Meta-Llama-3.1-8B-Instruct", "rtx-4090")
    qtbot.waitUntil(lambda: plan.batch_curve.xData is not None and len(plan.batch_curve.xData) > 3, timeout=20_000)
    QApplication.processEvents()
    for chart in (plan.batch_plot, plan.budget_plot, plan.run_box.plot):
        item = chart.getPlotItem()
        legend, view = item.legend, item.vb
        assert legend.parentItem() is not view  # not an overlay of the plotted area
        if chart is plan.run_box.plot:
            continue  # empty here (its note stands in for axes and legend): the same Chart.legend_below
        names = [text.text for _, text in legend.items]
        assert len(names) >= 2 and legend.isVisible(), names
        area = view.sceneBoundingRect()
        for sample, text in legend.items:
            for part in (sample, text):
                box = part.sceneBoundingRect()
                assert not box.intersects(area), (names, box, area)
                assert box.top() >= chart.getAxis("bottom").sceneBoundingRect().bottom() - 1  # under the label
                assert box.left() >= 0 and box.right() <= chart.width(), (names, box, chart.width())  # not clipped


def test_a_flat_curve_is_drawn_from_zero(app_window, qtbot):
    """The built-in model fits in the least memory the chart tries: its tokens/s by memory is flat, and the axis
    zoomed into the flat line's rounding (29.0-29.6). Tokens/s axes start at 0 (session 11)."""
    app_window.show_page("Plan")  # a new user's model: the built-in one (test_new_user_model.py)
    plan = app_window.plan_page
    plan.hardware_combo.setCurrentIndex(plan.hardware_combo.findData("cpu-generic"))
    qtbot.waitUntil(lambda: plan.result is not None and plan.headline.text().endswith("on cpu-generic")
                    and plan.charts is not None and plan.budget_curve.yData is not None, timeout=20_000)
    QApplication.processEvents()
    values = plan.budget_curve.yData
    assert values.max() - values.min() < 0.05 * values.max()  # flat
    for chart in (plan.batch_plot, plan.budget_plot):
        low, high = chart.getViewBox().viewRange()[1]
        assert low == 0 and high >= max(curve.yData.max() for curve in chart.getPlotItem().listDataItems()
                                        if curve.yData is not None and len(curve.yData)), (low, high)
