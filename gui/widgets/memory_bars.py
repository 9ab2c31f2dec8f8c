"""A stacked bar per memory tier: weights / KV cache / activations and buffers / free (painted, no plot library)."""

from __future__ import annotations

from PySide6.QtCore import QRectF, QSize, Qt
from PySide6.QtGui import QColor, QPainter, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget

from hivekeeper.gui.viewmodels.plan_view import TierBar
from hivekeeper.gui.style import ACTIVATIONS, BAD, FREE, INK, KV_CACHE, MUTED, WEIGHTS, fmt_bytes

TIER_NAMES = {"gpu": "GPU", "cpu": "RAM", "disk": "Disk"}
SEGMENTS = (("weights", WEIGHTS), ("KV cache", KV_CACHE), ("activations & buffers", ACTIVATIONS), ("free", FREE))


class MemoryBars(QWidget):
    ROW = 30
    LABEL_WIDTH = 120
    LEGEND = 26

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.bars: list[TierBar] = []
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setMinimumHeight(3 * self.ROW + self.LEGEND + 8)

    def sizeHint(self) -> QSize:
        return QSize(500, 3 * self.ROW + self.LEGEND + 8)

    def set_bars(self, bars: list[TierBar]) -> None:
        # a tier with no capacity and nothing on it (no GPU, no disk use in swarm mode) is left out
        self.bars = [b for b in bars if b.capacity > 0 or b.used > 0]
        self.setToolTip("\n".join(
            f"{TIER_NAMES[b.tier]}: weights {fmt_bytes(b.weights)}, KV cache {fmt_bytes(b.kv_cache)}, "
            f"activations & buffers {fmt_bytes(b.activations)}, free {fmt_bytes(b.free)} of {fmt_bytes(b.capacity)}"
            for b in self.bars))
        self.setFixedHeight(max(1, len(self.bars)) * self.ROW + self.LEGEND + 8)
        self.update()

    def paintEvent(self, event) -> None:
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        width = self.width() - self.LABEL_WIDTH - 90
        for row, bar in enumerate(self.bars):
            y = row * self.ROW + 4
            painter.setPen(QColor(INK))
            painter.drawText(QRectF(0, y, self.LABEL_WIDTH - 8, self.ROW - 8),
                             Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignLeft,
                             f"{TIER_NAMES[bar.tier]}  {fmt_bytes(bar.capacity)}")
            scale = max(bar.capacity, bar.used, 1.0)
            x = float(self.LABEL_WIDTH)
            for value, (_, color) in zip((bar.weights, bar.kv_cache, bar.activations, bar.free), SEGMENTS, strict=True):
                w = width * value / scale
                if w <= 0:
                    continue
                painter.fillRect(QRectF(x, y, w, self.ROW - 10), QColor(color))
                x += w
            if bar.over:
                painter.setPen(QPen(QColor(BAD), 2))
                cap_x = self.LABEL_WIDTH + width * bar.capacity / scale
                painter.drawLine(int(cap_x), y - 2, int(cap_x), y + self.ROW - 8)
            painter.setPen(QColor(BAD if bar.over else MUTED))
            used = bar.used / bar.capacity if bar.capacity else 1.0
            painter.drawText(QRectF(self.LABEL_WIDTH + width + 8, y, 82, self.ROW - 8),
                             Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignLeft,
                             "over!" if bar.over else f"{100 * used:.0f}% used")
        # legend
        y = max(1, len(self.bars)) * self.ROW + 6
        x = float(self.LABEL_WIDTH)
        for name, color in SEGMENTS:
            painter.fillRect(QRectF(x, y + 4, 12, 12), QColor(color))
            painter.setPen(QColor(MUTED))
            text_width = painter.fontMetrics().horizontalAdvance(name) + 24
            painter.drawText(QRectF(x + 16, y, text_width, 20), Qt.AlignmentFlag.AlignVCenter, name)
            x += text_width + 10
        painter.end()
