"""The Chat page's switch for the OpenAI-compatible API: a checkbox "OpenAI API on port N", the URL as
selectable text once it serves, and one status or error line. It serves the model the page would chat with
(`model_for_api`), read when the box is ticked; the child process lives in services/api_server.py.
"""

from __future__ import annotations

from typing import Callable

from PySide6.QtWidgets import QCheckBox, QHBoxLayout, QSpinBox, QVBoxLayout, QWidget

from hivekeeper.core.api import DEFAULT_PORT

from hivekeeper.gui.services.api_server import ApiLaunch, ApiServerService
from hivekeeper.gui.style import BAD, MUTED, label

STATE_WORDS = {"stopped": "", "loading": "loading {model}…", "serving": "serving {model}",
               "stopping": "stopping…"}


class ApiSwitch(QWidget):
    def __init__(self, model_for_api: Callable[[], str], service: ApiServerService | None = None,
                 parent: QWidget | None = None):
        super().__init__(parent)
        self.model_for_api = model_for_api
        self.service = service or ApiServerService(self)
        column = QVBoxLayout(self)
        column.setContentsMargins(0, 0, 0, 0)
        column.setSpacing(2)
        row = QHBoxLayout()
        self.checkbox = QCheckBox("OpenAI API on port")  # fits the Chat page's settings column
        self.checkbox.setToolTip("An OpenAI-compatible API: serve the chat model at http://127.0.0.1:PORT/v1 for "
                                 "editors, notebooks and the openai client (this machine only)")
        self.port_spin = QSpinBox()
        self.port_spin.setRange(1, 65535)
        self.port_spin.setValue(DEFAULT_PORT)
        row.addWidget(self.checkbox)
        row.addWidget(self.port_spin)
        row.addStretch(1)
        column.addLayout(row)
        self.url_label = label("", "small")
        self.status_label = label("", "small", wrap=True)
        column.addWidget(self.url_label)
        column.addWidget(self.status_label)
        self.checkbox.toggled.connect(self._toggled)
        self.service.stateChanged.connect(self._show_state)
        self._show_state(self.service.state)

    def _toggled(self, on: bool) -> None:
        if on and not self.service.running:
            self.service.start(ApiLaunch(self.model_for_api(), self.port_spin.value()))
        elif not on:
            self.service.stop()

    def _show_state(self, state: str) -> None:
        running = state in ("loading", "serving", "stopping")
        self.checkbox.blockSignals(True)  # an exit not asked for unticks the box without stopping anything
        self.checkbox.setChecked(state in ("loading", "serving"))
        self.checkbox.blockSignals(False)
        self.port_spin.setEnabled(not running)
        self.url_label.setText(self.service.url if state == "serving" else "")
        self.url_label.setVisible(state == "serving")
        if state == "error":
            self.status_label.setStyleSheet(f"color: {BAD}")
            self.status_label.setText(f"API stopped: {self.service.error}")
        else:
            model = self.service.launch.model if self.service.launch else ""
            self.status_label.setStyleSheet(f"color: {MUTED}")
            self.status_label.setText(STATE_WORDS[state].format(model=model))
        self.status_label.setVisible(bool(self.status_label.text()))

    def shutdown(self) -> None:
        """Stop the API and wait for its end (the app is closing)."""
        self.service.stop(wait=True)
