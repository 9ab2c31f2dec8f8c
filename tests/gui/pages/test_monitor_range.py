"""Review (issue 14, a new user's pass): the Monitor's "Machine use" chart has room above 100%, so a CPU at full
use draws a line below the chart's top edge, not on it; its range stays put while samples come in; and its axis
shows "0" (session 11: a range starting exactly at 0 put that tick on the edge, where pyqtgraph draws none)."""

from __future__ import annotations

import time

from PySide6.QtCore import QPointF
from PySide6.QtGui import QImage, QPainter


def test_a_full_cpu_line_is_drawn_below_the_charts_edge(app_window, qtbot):
    app_window.show_page("Monitor")
    page = app_window.monitor_page
    plot = page.plots["Machine use"]
    view = plot.getViewBox()
    page.buffers["cpu"].append(time.time(), 100.0)  # a full CPU (the sampler adds real samples beside it)
    redraws = page.redraws
    qtbot.waitUntil(lambda: page.redraws > redraws + 2 and len(page.buffers["cpu"]) > 2, timeout=10_000)
    low, high = view.viewRange()[1]
    assert -5 <= low < 0 and high >= 105, (low, high)
    top = view.mapViewToScene(QPointF(0, high)).y()
    full = view.mapViewToScene(QPointF(0, 100)).y()
    assert full - top >= 8, (top, full)  # pixels between the 100% line and the chart's top edge


def drawn_labels(axis) -> list[str]:
    """The tick labels an axis draws now (pyqtgraph's own drawing specs, measured with a real painter)."""
    image = QImage(8, 8, QImage.Format.Format_ARGB32)
    painter = QPainter(image)
    try:
        _, _, texts = axis.generateDrawSpecs(painter)
    finally:
        painter.end()
    return [text for _, _, text in texts]


def test_the_machine_use_axis_shows_zero(app_window, qtbot):
    app_window.show_page("Monitor")
    page = app_window.monitor_page
    redraws = page.redraws
    qtbot.waitUntil(lambda: page.redraws > redraws + 1, timeout=10_000)
    labels = drawn_labels(page.plots["Machine use"].getAxis("left"))
    assert labels[:1] == ["0"] and "100" in labels, labels
