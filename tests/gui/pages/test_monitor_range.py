"""Review (issue 14, a new user's pass): the Monitor's "Machine use" chart has room above 100%, so a CPU at full
use draws a line below the chart's top edge, not on it; its range stays put while samples come in."""

from __future__ import annotations

import time

from PySide6.QtCore import QPointF


def test_a_full_cpu_line_is_drawn_below_the_charts_edge(app_window, qtbot):
    app_window.show_page("Monitor")
    page = app_window.monitor_page
    plot = page.plots["Machine use"]
    view = plot.getViewBox()
    page.buffers["cpu"].append(time.time(), 100.0)  # a full CPU (the sampler adds real samples beside it)
    redraws = page.redraws
    qtbot.waitUntil(lambda: page.redraws > redraws + 2 and len(page.buffers["cpu"]) > 2, timeout=10_000)
    low, high = view.viewRange()[1]
    assert low == 0 and high >= 105, (low, high)
    top = view.mapViewToScene(QPointF(0, high)).y()
    full = view.mapViewToScene(QPointF(0, 100)).y()
    assert full - top >= 8, (top, full)  # pixels between the 100% line and the chart's top edge
