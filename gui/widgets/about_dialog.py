"""The About box (Help → About Hivekeeper): Hivekeeper's version and those of Python, torch, hivemind, PySide6 and
Qt, the lines a bug report needs, selectable so they can be copied.

The versions come from core/version.py (package metadata: torch and hivemind are not imported for this) and from Qt
itself. A plain QDialog rather than QMessageBox: QMessageBox fixes its size again each time it is shown, a round trip
to the platform (and a warning on Qt's offscreen platform). The box is window-modal and opens without blocking.
"""

from __future__ import annotations

from html import escape

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QHBoxLayout, QLabel, QLayout, QVBoxLayout, QWidget

from hivekeeper.core.version import component_versions

SUMMARY = ("Plans, runs and serves large language models on your own hardware and in a Petals-compatible "
           "volunteer swarm.")


def about_versions() -> dict[str, str]:
    """Name -> version: Hivekeeper, Python, torch, hivemind, then PySide6 and the Qt it runs."""
    import PySide6
    from PySide6.QtCore import qVersion

    return {**component_versions(), "PySide6": PySide6.__version__, "Qt": qVersion()}


def about_html(versions: dict[str, str]) -> str:
    rows = "".join(f"<tr><td>{escape(name)}</td><td>&nbsp;{escape(value)}</td></tr>"
                   for name, value in versions.items() if name != "Hivekeeper")
    return (f"<p><b>Hivekeeper {escape(versions['Hivekeeper'])}</b></p><p>{escape(SUMMARY)}</p>"
            f"<table>{rows}</table>")


def about_box(parent: QWidget) -> QDialog:
    """The About box, built but not shown (the caller opens it). Its text label is named `versions`."""
    box = QDialog(parent)
    box.setObjectName("about")
    box.setWindowTitle("About Hivekeeper")
    box.setWindowModality(Qt.WindowModality.WindowModal)
    icon = QLabel()
    icon.setPixmap(parent.windowIcon().pixmap(64, 64))
    icon.setAlignment(Qt.AlignmentFlag.AlignTop)
    text = QLabel(about_html(about_versions()))
    text.setObjectName("versions")
    text.setTextFormat(Qt.TextFormat.RichText)
    text.setWordWrap(True)
    text.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
    buttons.rejected.connect(box.reject)
    row = QHBoxLayout()
    row.addWidget(icon)
    row.addWidget(text, 1)
    layout = QVBoxLayout(box)
    layout.addLayout(row)
    layout.addWidget(buttons)
    layout.setSizeConstraint(QLayout.SizeConstraint.SetNoConstraint)  # sized once, below, not at each show
    box.resize(460, box.sizeHint().height())
    return box
