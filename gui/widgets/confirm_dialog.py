"""A window-modal question with a destructive button and Cancel (the Models page's "Remove model?").

A plain QDialog rather than QMessageBox, for the reason about_dialog.py gives (QMessageBox fixes its size at each
show, which Qt's offscreen platform warns about). It opens without blocking; `accepted` means the destructive
button was clicked.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QLabel, QLayout, QVBoxLayout, QWidget


def confirm_dialog(parent: QWidget, title: str, question: str, action: str) -> QDialog:
    """The dialog, built but not shown; its buttons are `action` (accept) and Cancel (reject)."""
    box = QDialog(parent)
    box.setObjectName("confirm")
    box.setWindowTitle(title)
    box.setWindowModality(Qt.WindowModality.WindowModal)
    text = QLabel(question)
    text.setWordWrap(True)
    buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Cancel)
    buttons.addButton(action, QDialogButtonBox.ButtonRole.AcceptRole)
    buttons.accepted.connect(box.accept)
    buttons.rejected.connect(box.reject)
    layout = QVBoxLayout(box)
    layout.addWidget(text)
    layout.addWidget(buttons)
    layout.setSizeConstraint(QLayout.SizeConstraint.SetNoConstraint)
    box.resize(440, box.sizeHint().height())
    return box
