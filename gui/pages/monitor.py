"""Page 5, Monitor: live plots of chat and node speed, step latency, requests served, CPU / GPU / RAM use; and what
this machine has given the swarm, today and in total (gui/widgets/contribution_panel.py).

Samples go into ring buffers as they arrive (chat replies, node status lines, a 2 Hz system sampler); the plots
are redrawn from the buffers at 5 Hz, and not at all while paused (the buffers keep filling).
"""

from __future__ import annotations

import time

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QGridLayout, QHBoxLayout, QPushButton, QVBoxLayout, QWidget

from hivekeeper.gui.services.node import NodeService
from hivekeeper.gui.viewmodels.ring_buffer import RingBuffer
from hivekeeper.gui.style import ACCENT, BAD, GOOD, KV_CACHE, WARN, label, page_layout
from hivekeeper.gui.services.system_usage import SystemUsage
from hivekeeper.gui.widgets.contribution_panel import ContributionPanel

WINDOW_S = 120.0  # seconds shown
PERCENT_TOP = 110  # the top of the "Machine use" chart (%)
# ... and its bottom, a little below 0: pyqtgraph draws no tick (nor its "0") exactly on the chart's edge
PERCENT_BOTTOM = -3
SERIES = {
    "chat_tps": ("chat tokens/s", ACCENT),
    "node_rps": ("node requests/s", GOOD),
    "chat_latency_ms": ("chat ms per token", ACCENT),
    "node_latency_ms": ("node ms per step (its measured speed)", GOOD),
    "node_requests": ("requests served", GOOD),
    "node_sessions": ("open sessions", WARN),
    "cpu": ("CPU %", ACCENT),
    "ram": ("RAM %", KV_CACHE),
    "gpu": ("GPU %", BAD),
}


PER_REPLY = ("chat_tps", "chat_latency_ms")  # one sample per chat reply: points, not a line between replies


def separate_points(t: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The samples with a NaN between each two, so that a curve drawn with connect="finite" joins none of them."""
    if len(t) < 2:
        return t, v
    gap_t = np.empty(2 * len(t) - 1)
    gap_v = np.full(2 * len(t) - 1, np.nan)
    gap_t[0::2], gap_t[1::2] = t, t[:-1]
    gap_v[0::2] = v
    return gap_t, gap_v


class MonitorPage(QWidget):
    def __init__(self, node: NodeService, parent: QWidget | None = None, sample_ms: int = 500, redraw_ms: int = 200):
        super().__init__(parent)
        self.buffers = {name: RingBuffer(1200) for name in SERIES}
        self.paused = False
        self.redraws = 0
        self._node_last: tuple[float, int] | None = None  # (time, requests_served) of the previous stats line
        self.usage = SystemUsage()

        layout = page_layout(self, QVBoxLayout, (24, 18))
        header = QHBoxLayout()
        header.addWidget(label("Monitor", "title"))
        header.addStretch(1)
        self.summary = label("", "small")
        header.addWidget(self.summary)
        self.pause_button = QPushButton("Pause")
        self.pause_button.setCheckable(True)
        self.pause_button.toggled.connect(self.set_paused)
        header.addWidget(self.pause_button)
        layout.addLayout(header)
        layout.addWidget(label(f"The last {WINDOW_S:.0f} seconds. Chat numbers come from replies on the Chat page, "
                               "node numbers from the serving node's status lines.", "subtitle", wrap=True))

        grid = QGridLayout()
        grid.setSpacing(10)
        self.curves: dict[str, pg.PlotDataItem] = {}
        panels = (("Speed", "per second", ("chat_tps", "node_rps")),
                  ("Step latency", "ms", ("chat_latency_ms", "node_latency_ms")),
                  ("Node requests", "count", ("node_requests", "node_sessions")),
                  ("Machine use", "%", ("cpu", "ram", "gpu")))
        self.plots: dict[str, pg.PlotWidget] = {}
        for i, (title, unit, names) in enumerate(panels):
            plot = pg.PlotWidget()
            plot.setTitle(title, color="#616e7c", size="10pt")
            plot.setLabel("left", unit)
            plot.setLabel("bottom", "seconds ago")
            plot.showGrid(x=True, y=True, alpha=0.2)
            plot.setMenuEnabled(False)
            plot.setXRange(-WINDOW_S, 0, padding=0)
            plot.addLegend(offset=(8, 8), labelTextSize="8pt")
            if unit == "%":  # a fixed range, headroom above 100% so a full CPU's line is not on the edge
                plot.setYRange(PERCENT_BOTTOM, PERCENT_TOP, padding=0)
            for name in names:
                if name == "gpu" and not self.usage.has_gpu:
                    continue
                text, color = SERIES[name]
                style = Qt.PenStyle.DashLine if name == "node_sessions" else Qt.PenStyle.SolidLine
                # chat samples are one per reply: dots make single replies visible
                # a NaN sample breaks the line (connect="finite"): separate chat replies are not joined
                self.curves[name] = plot.plot([], [], pen=pg.mkPen(color, width=2, style=style), name=text,
                                              symbol="o" if name.startswith("chat") else None, symbolSize=5,
                                              symbolBrush=color, connect="finite")
            self.plots[title] = plot
            grid.addWidget(plot, i // 2, i % 2)
        layout.addLayout(grid, 1)
        self.contribution = ContributionPanel()  # today's and total requests, tokens, uptime, energy (issue 20)
        layout.addWidget(self.contribution)

        node.statusReceived.connect(self.record_node_status)
        node.statusReceived.connect(self.contribution.record_node_status)
        self._sampler = QTimer(self)
        self._sampler.timeout.connect(self.sample_system)
        self._sampler.start(sample_ms)
        self._redraw = QTimer(self)
        self._redraw.timeout.connect(self.redraw)
        self._redraw.start(redraw_ms)

    # ---- inputs ----------------------------------------------------------------------------------------------------
    def record_chat_reply(self, tokens_per_s: float, ms_per_token: float) -> None:
        """One reply's speed: one point (redraw keeps replies apart: separate_points)."""
        now = time.time()
        self.buffers["chat_tps"].append(now, tokens_per_s)
        self.buffers["chat_latency_ms"].append(now, ms_per_token)

    def record_node_status(self, event: dict) -> None:
        now = float(event.get("time") or time.time())
        served = event.get("requests_served")
        if served is None:
            return
        self.buffers["node_requests"].append(now, float(served))
        self.buffers["node_sessions"].append(now, float(event.get("sessions") or 0))
        if self._node_last is not None and now > self._node_last[0]:
            rate = (served - self._node_last[1]) / (now - self._node_last[0])
            self.buffers["node_rps"].append(now, max(0.0, rate))
        if event.get("inference_rps") and event.get("blocks"):
            start, end = event["blocks"]
            # a 1-token step through the whole span, from the node's measured per-block speed
            self.buffers["node_latency_ms"].append(now, 1e3 * (end - start) / event["inference_rps"])
        self._node_last = (now, int(served))

    def sample_system(self) -> None:
        now = time.time()
        usage = self.usage.sample()
        for name in ("cpu", "ram", "gpu"):
            if usage.get(name) is not None:
                self.buffers[name].append(now, float(usage[name]))

    # ---- drawing ---------------------------------------------------------------------------------------------------
    def set_paused(self, paused: bool) -> None:
        self.paused = paused
        self.pause_button.setText("Resume" if paused else "Pause")
        if not paused:
            self.redraw()

    def redraw(self) -> None:
        if self.paused or not self.isVisible():
            return
        now = time.time()
        for name, curve in self.curves.items():
            t, v = self.buffers[name].arrays()
            keep = t >= now - WINDOW_S
            t, v = t[keep] - now, v[keep]
            if name in PER_REPLY:
                t, v = separate_points(t, v)
            curve.setData(t, v)
        self.redraws += 1
        cpu, ram = self.buffers["cpu"].last(), self.buffers["ram"].last()
        parts = []
        if cpu is not None:
            parts.append(f"CPU {cpu:.0f}%")
        if ram is not None:
            parts.append(f"RAM {ram:.0f}%")
        gpu = self.buffers["gpu"].last()
        if gpu is not None:
            parts.append(f"GPU {gpu:.0f}%")
        self.summary.setText("  ·  ".join(parts))

    def shutdown(self) -> None:
        self._sampler.stop()
        self._redraw.stop()
        self.usage.close()
