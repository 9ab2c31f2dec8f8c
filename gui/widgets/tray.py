"""The node's state where the owner sees it: the system tray icon when the platform has one, and always the status
bar (the only place in offscreen runs and on desktops without a tray).

Both say serving / paused (and why) / offline, and hold the same menu: Show Hivekeeper, Pause for 1 hour, Resume,
Quit (the status bar's as a "Node ▾" button). Notifications (a join, a crash and its restart, a pause) are tray
balloons where there is a tray, status bar messages always, and kept in `notifications`.
"""

from __future__ import annotations

from typing import Callable

from PySide6.QtCore import QObject, Qt
from PySide6.QtGui import QAction, QColor, QIcon, QPainter, QPixmap
from PySide6.QtWidgets import QLabel, QMainWindow, QMenu, QSystemTrayIcon, QToolButton

from hivekeeper.gui.services.node import STATE_WORDS, NodeService
from hivekeeper.gui.style import STATE_COLORS

PAUSE_S = 3600.0  # "Pause for 1 hour"
NOTIFY_MS = 15_000


def dot_icon(color: str, size: int = 14) -> QIcon:
    pixmap = QPixmap(size, size)
    pixmap.fill(Qt.GlobalColor.transparent)
    painter = QPainter(pixmap)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    painter.setBrush(QColor(color))
    painter.setPen(Qt.PenStyle.NoPen)
    painter.drawEllipse(1, 1, size - 2, size - 2)
    painter.end()
    return QIcon(pixmap)


def node_summary(node: NodeService) -> str:
    """'serving', 'paused — why', 'offline' and the steps between, in words."""
    state = node.state
    if state == "online":
        return "serving (online)"
    if state == "paused":
        return f"paused — {node.pause_reason}" if node.pause_reason else "paused"
    if state == "error":
        text = "offline (error: " + (node.error[:120] or STATE_WORDS["error"]) + ")"
        return text + (f" (restarting in {node.restart_in:.0f} s)" if node.restart_in is not None else "")
    if state == "stopped":
        return "offline"
    return STATE_WORDS.get(state, state)


class NodeTray(QObject):
    """The tray icon (or None), the status bar's label and menu button, and the notifications, for one node."""

    def __init__(self, window: QMainWindow, node: NodeService, show: Callable[[], None],
                 quit_app: Callable[[], None]):
        super().__init__(window)
        self.window, self.node = window, node
        self.notifications: list[tuple[str, str]] = []
        self.menu = self._make_menu(window, show, quit_app)
        self.label = QLabel()
        self.label.setContentsMargins(8, 0, 8, 0)
        self.button = QToolButton()
        self.button.setText("Node")
        self.button.setMenu(self.menu)
        self.button.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        window.statusBar().addPermanentWidget(self.label)
        window.statusBar().addPermanentWidget(self.button)
        self.tray = self._make_tray(show) if QSystemTrayIcon.isSystemTrayAvailable() else None
        node.stateChanged.connect(self.update)
        node.notify.connect(self.notify)
        self.update(node.state)

    def _make_menu(self, window: QMainWindow, show, quit_app) -> QMenu:
        menu = QMenu(window)
        self.show_action = QAction("Show Hivekeeper", menu)
        self.show_action.triggered.connect(show)
        self.pause_action = QAction("Pause for 1 hour", menu)
        self.pause_action.triggered.connect(lambda: self.node.pause_for(PAUSE_S))
        self.resume_action = QAction("Resume", menu)
        self.resume_action.triggered.connect(self.node.resume)
        self.quit_action = QAction("Stop the node and quit", menu)
        self.quit_action.triggered.connect(quit_app)
        for action in (self.show_action, self.pause_action, self.resume_action, self.quit_action):
            menu.addAction(action)
        return menu

    def _make_tray(self, show) -> QSystemTrayIcon:
        tray = QSystemTrayIcon(dot_icon(STATE_COLORS["stopped"], 32), self.window)
        tray.setContextMenu(self.menu)
        tray.activated.connect(lambda reason: show())
        return tray

    def update(self, state: str) -> None:
        color = STATE_COLORS.get(state, "#616e7c")
        text = f"Node: {node_summary(self.node)}"
        self.label.setText(f"<span style='color:{color}'>●</span> {text}")
        self.pause_action.setEnabled(state in ("online", "joining", "moving"))
        self.resume_action.setEnabled(state == "paused")
        if self.tray is not None:
            self.tray.setIcon(dot_icon(color, 32))
            self.tray.setToolTip(f"Hivekeeper — {text}")
            if state in ("online", "joining", "starting", "paused"):
                self.tray.show()

    def notify(self, title: str, text: str) -> None:
        self.notifications.append((title, text))
        self.update(self.node.state)  # a crash's restart delay, a pause's reason
        self.window.statusBar().showMessage(f"{title}: {text}", NOTIFY_MS)
        if self.tray is not None and self.tray.isVisible():
            self.tray.showMessage(title, text, QSystemTrayIcon.MessageIcon.Information, NOTIFY_MS)
