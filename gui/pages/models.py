"""The Models page: the models on this machine (what `hivekeeper models list` shows), Remove with a confirmation,
and Pull from the Hugging Face hub with a progress bar and Stop.

The listing, removal and pull run off the GUI thread (gui/services/models.py); the rows and the progress words come
from gui/viewmodels/models_view.py. The confirmation is window-modal and non-blocking (`open()`), so the window
keeps painting while it asks.
"""

from __future__ import annotations

from PySide6.QtWidgets import (QAbstractItemView, QHBoxLayout, QHeaderView, QLabel, QLineEdit, QProgressBar,
                               QPushButton, QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget)

from hivekeeper.core.runtime.library import human_bytes

from hivekeeper.gui.services.models import ModelsService
from hivekeeper.gui.style import label, page_layout
from hivekeeper.gui.widgets.confirm_dialog import confirm_dialog
from hivekeeper.gui.viewmodels.models_view import (COLUMNS, model_rows, progress_percent, progress_text,
                                                   pull_argv_args)


class ModelsPage(QWidget):
    def __init__(self, service: ModelsService, parent: QWidget | None = None):
        super().__init__(parent)
        self.service = service
        self.models: list = []
        self.confirm_box = None  # the Remove confirmation, while asked
        self.notice = ""  # said before the count once the list is next shown (what was just removed)

        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.itemSelectionChanged.connect(self._selection_changed)
        self.refresh_button = QPushButton("Refresh")
        self.refresh_button.clicked.connect(self.refresh)
        self.remove_button = QPushButton("Remove…")
        self.remove_button.setEnabled(False)
        self.remove_button.clicked.connect(self.ask_remove)
        self.status = QLabel("")
        self.status.setWordWrap(True)

        self.pull_id = QLineEdit()
        self.pull_id.setPlaceholderText("hub id, e.g. Qwen/Qwen2.5-0.5B-Instruct-GGUF")
        self.pull_file = QLineEdit()
        self.pull_file.setPlaceholderText("file (for a repo of several GGUF files)")
        self.pull_button = QPushButton("Pull")
        self.pull_button.clicked.connect(self.start_pull)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setEnabled(False)
        self.stop_button.clicked.connect(self.service.abort_pull)
        self.progress = QProgressBar()
        self.progress.setRange(0, 100)
        self.progress_label = QLabel("")

        layout = page_layout(self, QVBoxLayout, (24, 18), 10)  # as every page: styled background, margins, title
        layout.addWidget(label("Models", "title"))
        layout.addWidget(label("Models on this machine: Hivekeeper's folder, the Hugging Face cache, Ollama and LM "
                               "Studio (read in place), and the built-in model.", "subtitle", wrap=True))
        layout.addWidget(self.table, 1)
        buttons = QHBoxLayout()
        buttons.addWidget(self.refresh_button)
        buttons.addWidget(self.remove_button)
        buttons.addWidget(self.status, 1)
        layout.addLayout(buttons)
        pull_row = QHBoxLayout()
        pull_row.addWidget(QLabel("Pull from the hub:"))
        pull_row.addWidget(self.pull_id, 2)
        pull_row.addWidget(self.pull_file, 1)
        pull_row.addWidget(self.pull_button)
        pull_row.addWidget(self.stop_button)
        layout.addLayout(pull_row)
        progress_row = QHBoxLayout()
        progress_row.addWidget(self.progress, 1)
        progress_row.addWidget(self.progress_label)
        layout.addLayout(progress_row)

        service.listed.connect(self.show_models)
        service.failed.connect(self.status.setText)
        service.removed.connect(self._removed)
        service.pullProgress.connect(self.show_progress)
        service.pulled.connect(self._pulled)
        service.pullFailed.connect(self._pull_failed)

    # ---- the list --------------------------------------------------------------------------------------------------
    def showEvent(self, event) -> None:
        super().showEvent(event)
        if not self.models and self.service.listing is None:  # the first time on screen
            self.refresh()

    def refresh(self) -> None:
        self.status.setText("Looking for models…")
        self.service.refresh()

    def show_models(self, models: list) -> None:
        self.models = models
        rows = model_rows(models)
        self.table.setRowCount(len(rows))
        for r, row in enumerate(rows):
            for c, cell in enumerate(row.cells):
                self.table.setItem(r, c, QTableWidgetItem(cell))
        self.status.setText(f"{self.notice} {len(rows)} model(s).".strip())
        self.notice = ""
        self._selection_changed()

    def selected(self):
        rows = self.table.selectionModel().selectedRows() if self.table.selectionModel() else []
        return self.models[rows[0].row()] if rows and rows[0].row() < len(self.models) else None

    def _selection_changed(self) -> None:
        model = self.selected()
        self.remove_button.setEnabled(model is not None and model.removable)

    # ---- removing --------------------------------------------------------------------------------------------------
    def ask_remove(self) -> None:
        model = self.selected()
        if model is None or not model.removable:
            return
        box = confirm_dialog(self, "Remove model", f"Delete {model.id} ({human_bytes(model.size_bytes)}) from "
                                                   f"{model.root}?", "Remove")
        box.accepted.connect(lambda: self._confirmed(model))
        self.confirm_box = box
        box.open()

    def _confirmed(self, model) -> None:
        self.status.setText(f"Removing {model.id}…")
        self.service.remove(model)

    def _removed(self, model_id: str, freed: int) -> None:
        self.notice = f"Removed {model_id} ({human_bytes(freed)} freed)."
        self.status.setText(self.notice)

    # ---- pulling ---------------------------------------------------------------------------------------------------
    def start_pull(self) -> None:
        try:
            args = pull_argv_args(self.pull_id.text(), self.pull_file.text())
        except ValueError as exc:
            self.progress_label.setText(str(exc))
            return
        self.progress.setValue(0)
        self.progress_label.setText(f"Asking the hub for {args[2]}…")
        self._pulling(True)
        self.service.pull(args)

    def show_progress(self, done: int, total: int) -> None:
        self.progress.setValue(progress_percent(done, total))
        self.progress_label.setText(progress_text(done, total))

    def _pulled(self, path: str) -> None:
        self._pulling(False)
        self.progress.setValue(100)
        self.progress_label.setText(f"Pulled into {path}")

    def _pull_failed(self, message: str) -> None:
        self._pulling(False)
        self.progress_label.setText(message)

    def _pulling(self, running: bool) -> None:
        self.pull_button.setEnabled(not running)
        self.stop_button.setEnabled(running)

    def shutdown(self) -> None:
        self.service.shutdown()
