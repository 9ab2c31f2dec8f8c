"""Page 7, Settings: when the node steps aside for the owner, and what it may hold.

Pause while the keyboard and mouse were used in the last N minutes, on battery, while other programs use more than
X% of the CPUs, outside the serving hours; limits on CPU threads, RAM and GPU memory. They are NodeSettings (saved
with the app's settings) and reach the node as serve's flags of the same names (core/swarm/server/pause.py), which
are also the headless node's config keys. A change applies the next time the node starts.
"""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (QCheckBox, QDoubleSpinBox, QFormLayout, QLineEdit, QSpinBox, QVBoxLayout, QWidget)

from hivekeeper.core.swarm.server.pause import parse_hours
from hivekeeper.gui.settings import NodeSettings
from hivekeeper.gui.style import BAD, label, page_layout


def _spin(maximum: float, suffix: str, decimals: int = 1) -> QDoubleSpinBox:
    spin = QDoubleSpinBox()
    spin.setRange(0.0, maximum)
    spin.setDecimals(decimals)
    spin.setSuffix(suffix)
    spin.setSpecialValueText("off")  # 0 shows as "off"
    return spin


class SettingsPage(QWidget):
    """The node's pause conditions and limits; `settingsChanged` after each valid change."""

    settingsChanged = Signal()

    def __init__(self, settings: NodeSettings, parent: QWidget | None = None):
        super().__init__(parent)
        self.settings = settings
        layout = page_layout(self, QVBoxLayout, (24, 18), 10)
        layout.addWidget(label("Settings", "title"))
        layout.addWidget(label("Step aside for me", "subtitle"))
        layout.addWidget(label("The node leaves the swarm gracefully while any of these holds (its clients move to "
                               "other servers without losing a token), frees its memory, and rejoins when none "
                               "does. Changes apply the next time the node starts.", "small", wrap=True))
        form = QFormLayout()
        self.idle_spin = _spin(24 * 60, " min")
        self.battery_check = QCheckBox("Pause while on battery")
        self.cpu_spin = _spin(100, " %", 0)
        self.hours_edit = QLineEdit()
        self.hours_edit.setPlaceholderText("all day (e.g. 22-7 or 9:30-17:00)")
        self.threads_spin = QSpinBox()
        self.threads_spin.setRange(0, 4096)
        self.threads_spin.setSpecialValueText("all")
        self.ram_spin = _spin(1e6, " GiB")
        self.gpu_spin = _spin(1e6, " GiB")
        self.ram_spin.setSpecialValueText("no limit")
        self.gpu_spin.setSpecialValueText("no limit")
        form.addRow("Pause while I used the computer in the last", self.idle_spin)
        form.addRow("", self.battery_check)
        form.addRow("Pause while other programs use more CPU than", self.cpu_spin)
        form.addRow("Serve only between", self.hours_edit)
        form.addRow("CPU threads the node may use", self.threads_spin)
        form.addRow("RAM the node may hold", self.ram_spin)
        form.addRow("GPU memory the node may hold", self.gpu_spin)
        layout.addLayout(form)
        self.error_label = label("", wrap=True)
        self.error_label.setStyleSheet(f"color: {BAD};")
        layout.addWidget(self.error_label)
        self.args_label = label("", "small", wrap=True)
        layout.addWidget(self.args_label)
        layout.addStretch(1)
        self._show(settings)
        for spin in (self.idle_spin, self.cpu_spin, self.ram_spin, self.gpu_spin, self.threads_spin):
            spin.valueChanged.connect(self._changed)
        self.battery_check.toggled.connect(self._changed)
        self.hours_edit.editingFinished.connect(self._changed)

    def _show(self, s: NodeSettings) -> None:
        self.idle_spin.setValue(s.idle_minutes)
        self.battery_check.setChecked(s.on_battery)
        self.cpu_spin.setValue(s.cpu_above)
        self.hours_edit.setText(s.serve_hours)
        self.threads_spin.setValue(s.cpu_threads)
        self.ram_spin.setValue(s.ram_gib)
        self.gpu_spin.setValue(s.gpu_gib)
        self._show_args()

    def _show_args(self) -> None:
        args = " ".join(self.settings.serve_args())
        self.args_label.setText(f"The node runs with: {args}" if args else "The node never pauses on its own.")

    def _changed(self, *_) -> None:
        hours = self.hours_edit.text().strip()
        if hours:
            try:
                parse_hours(hours)
            except ValueError as exc:
                self.error_label.setText(f"Serving hours {exc}")
                return
        self.error_label.setText("")
        s = self.settings
        s.idle_minutes, s.on_battery, s.cpu_above = self.idle_spin.value(), self.battery_check.isChecked(), \
            self.cpu_spin.value()
        s.serve_hours, s.cpu_threads = hours, self.threads_spin.value()
        s.ram_gib, s.gpu_gib = self.ram_spin.value(), self.gpu_spin.value()
        self._show_args()
        self.settingsChanged.emit()
