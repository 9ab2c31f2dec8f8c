"""Look and feel: one palette, one stylesheet, pyqtgraph's colours, and the small widgets every page reuses."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFrame, QLabel, QSizePolicy, QVBoxLayout, QWidget

# palette
INK = "#1f2933"
MUTED = "#616e7c"
LINE = "#d9e2ec"
PANEL = "#ffffff"
BACKGROUND = "#f5f7fa"
ACCENT = "#2f80ed"
GOOD = "#27ae60"
WARN = "#f2994a"
BAD = "#eb5757"
# memory bar segments
WEIGHTS = "#2f80ed"
KV_CACHE = "#9b51e0"
ACTIVATIONS = "#f2994a"
FREE = "#e4e7eb"
OTHERS = "#9aa5b1"

STATE_COLORS = {"online": GOOD, "joining": WARN, "starting": WARN, "moving": WARN, "leaving": WARN,
                "paused": "#8e44ad", "error": BAD, "stopped": MUTED}
SOURCE_COLORS = {"measured": GOOD, "detected": ACCENT, "catalog": "#3e4c59", "derived": "#8e44ad",
                 "estimated": WARN, "default": WARN, "user": "#16a085"}

STYLESHEET = f"""
QMainWindow, QWidget#page {{ background: {BACKGROUND}; }}
QWidget {{ color: {INK}; font-size: 13px; }}
QListWidget#nav {{ background: #1f2933; color: #e4e7eb; border: none; font-size: 14px; padding-top: 8px; }}
QListWidget#nav::item {{ padding: 12px 16px; }}
QListWidget#nav::item:selected {{ background: {ACCENT}; color: white; }}
QFrame#card {{ background: {PANEL}; border: 1px solid {LINE}; border-radius: 8px; }}
QLabel#title {{ font-size: 20px; font-weight: 600; }}
QLabel#subtitle {{ color: {MUTED}; }}
QLabel#cardTitle {{ color: {MUTED}; font-size: 12px; text-transform: uppercase; }}
QLabel#big {{ font-size: 26px; font-weight: 600; }}
QLabel#small {{ color: {MUTED}; font-size: 12px; }}
QLabel#error {{ color: {BAD}; }}
QPushButton {{ padding: 6px 14px; border: 1px solid {LINE}; border-radius: 6px; background: white; }}
QPushButton:hover {{ border-color: {ACCENT}; }}
QPushButton:disabled {{ color: #9aa5b1; background: #f0f4f8; }}
QPushButton#primary {{ background: {ACCENT}; color: white; border: none; font-weight: 600; }}
QPushButton#primary:disabled {{ background: #9fc3f5; }}
QPushButton#danger {{ background: {BAD}; color: white; border: none; font-weight: 600; }}
QPushButton#danger:disabled {{ background: #f5b7b7; }}
QGroupBox {{ border: 1px solid {LINE}; border-radius: 8px; margin-top: 14px; background: {PANEL}; padding: 6px; }}
QGroupBox::title {{ subcontrol-origin: margin; left: 10px; padding: 0 4px; color: {MUTED}; }}
QTableWidget {{ background: white; border: 1px solid {LINE}; gridline-color: {LINE}; }}
QHeaderView::section {{ background: #f0f4f8; border: none; padding: 6px; color: {MUTED}; }}
QProgressBar {{ border: 1px solid {LINE}; border-radius: 4px; text-align: center; background: white; }}
QProgressBar::chunk {{ background: {ACCENT}; border-radius: 4px; }}
QTextBrowser, QPlainTextEdit, QLineEdit {{ background: white; border: 1px solid {LINE}; border-radius: 4px;
    padding: 3px; }}
"""


def configure_pyqtgraph() -> None:
    import pyqtgraph as pg

    pg.setConfigOptions(background="w", foreground=MUTED, antialias=True)


def card(layout_parent: QWidget | None = None) -> QFrame:
    frame = QFrame(layout_parent)
    frame.setObjectName("card")
    return frame


def label(text: str = "", role: str | None = None, wrap: bool = False) -> QLabel:
    widget = QLabel(text)
    if role:
        widget.setObjectName(role)
    widget.setWordWrap(wrap)
    widget.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    return widget


class StatCard(QFrame):
    """A number with a caption and a smaller line under it (e.g. the roofline bound)."""

    def __init__(self, caption: str, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("card")
        self.caption = label(caption, "cardTitle")
        self.value = label("–", "big")
        self.detail = label("", "small", wrap=True)
        self.value_style = ""
        layout = QVBoxLayout(self)
        layout.setContentsMargins(14, 10, 14, 10)
        layout.setSpacing(2)
        layout.addWidget(self.caption)
        layout.addWidget(self.value)
        layout.addWidget(self.detail)
        layout.addStretch(1)
        self.detail.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Maximum)

    def set_value_style(self, css: str) -> None:
        """Extra style for the number (kept when set() colours it)."""
        self.value_style = css
        self.value.setStyleSheet(css)

    def set(self, value: str, detail: str = "", color: str | None = None) -> None:
        self.value.setText(value)
        self.value.setStyleSheet(self.value_style + (f" color: {color};" if color else ""))
        self.detail.setText(detail)


def page_widget() -> QWidget:
    widget = QWidget()
    widget.setObjectName("page")
    return widget


def page_layout(page: QWidget, layout_class, margins: tuple[int, int], spacing: int | None = None):
    """What every page sets up first: the styled page background filling `page`, and a layout of `layout_class`
    (QHBoxLayout / QVBoxLayout) inside it with (horizontal, vertical) margins. Returns that layout."""
    root = page_widget()
    outer = QVBoxLayout(page)
    outer.setContentsMargins(0, 0, 0, 0)
    outer.addWidget(root)
    layout = layout_class(root)
    layout.setContentsMargins(margins[0], margins[1], margins[0], margins[1])
    if spacing is not None:
        layout.setSpacing(spacing)
    return layout


def fmt_rate(tokens_per_s: float | None) -> str:
    """A rate (tokens/s, requests/s) with sensible digits: "2,034", "23.7", "4.56"."""
    if tokens_per_s is None:
        return "–"
    if tokens_per_s >= 100:
        return f"{tokens_per_s:,.0f}"
    if tokens_per_s >= 10:
        return f"{tokens_per_s:.1f}"
    return f"{tokens_per_s:.3g}"


def fmt_bytes(value: float | None) -> str:
    if value is None:
        return "–"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} B"


def fmt_energy(joules: float | None) -> str:
    if joules is None:
        return "–"
    for unit, scale in (("MJ", 1e6), ("kJ", 1e3)):
        if joules >= scale:
            return f"{joules / scale:.3g} {unit}"
    return f"{joules:.3g} J"


def fmt_seconds(value: float | None) -> str:
    if value is None:
        return "–"
    if value >= 3600:
        return f"{value / 3600:.2g} h"
    if value >= 60:
        return f"{value / 60:.2g} min"
    if value >= 1:
        return f"{value:.3g} s"
    return f"{value * 1e3:.3g} ms"
