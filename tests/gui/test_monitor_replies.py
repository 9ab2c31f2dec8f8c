"""Issue 14 item 10, the Monitor of the real MainWindow: separate chat replies (the Chat page's replyMeasured, as
main_window wires it) are drawn as points with the line broken between them, while node samples stay one line."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg


def test_separate_replies_are_not_joined_by_a_line(make_window, qtbot):
    window = make_window()
    window.build_all_pages()
    window.show_page("Monitor")
    monitor = window.monitor_page
    chat = window.page("Chat")
    for tps, ms in ((12.5, 80.0), (30.0, 33.0), (18.0, 55.0)):  # three replies, each one sample
        chat.replyMeasured.emit(tps, ms)
    count = monitor.redraws
    qtbot.waitUntil(lambda: monitor.redraws > count, timeout=2_000)
    for name in ("chat_tps", "chat_latency_ms"):
        curve = monitor.curves[name]
        y = np.asarray(curve.yData)
        assert len(y) == 5 and np.isnan(y[1]) and np.isnan(y[3]), y
        assert list(y[0::2]) == list(monitor.buffers[name].arrays()[1])
        assert curve.opts["connect"] == "finite"
        # what is drawn: the line's path has no segment from one reply to the next
        path = pg.arrayToQPath(np.asarray(curve.xData), y, connect="finite")
        elements = [path.elementAt(i) for i in range(path.elementCount())]
        joins = [(a.x, a.y, b.x, b.y) for a, b in zip(elements, elements[1:])
                 if b.isLineTo() and (a.x, a.y) != (b.x, b.y)]
        assert joins == [], joins
        joined = pg.arrayToQPath(np.asarray(curve.xData)[0::2], y[0::2], connect="all")  # what it drew before
        assert joined.elementAt(1).isLineTo() and joined.elementAt(1).y != joined.elementAt(0).y
    window.node.statusReceived.emit({"state": "stats", "time": 1.0, "requests_served": 3, "sessions": 0})
    assert not np.isnan(monitor.buffers["node_requests"].arrays()[1]).any()
