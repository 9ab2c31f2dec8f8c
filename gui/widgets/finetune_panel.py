"""The Fine-tune panel, opened from the Chat page: train prompts for the chat's model and see the loss live.

Pick a data file (JSON lines, docs/finetune.md) and where the prompts go; Start trains on a worker
(core.finetune.trainer.open_trainer, the code `hivekeeper finetune` runs), each step adds a point to the loss curve
(pyqtgraph) and updates the status line (step, loss, tokens/s). Stop ends the run after the step in progress and
saves; Start again with the same file resumes it up to the steps asked. When a run saved prompts, `trained` gives
their file to the Chat page, which offers them as the chat's trained prompts.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Callable

import pyqtgraph as pg
from PySide6.QtCore import Signal
from PySide6.QtWidgets import (QComboBox, QDialog, QDoubleSpinBox, QFileDialog, QFormLayout, QHBoxLayout, QLayout,
                               QLineEdit, QPushButton, QSpinBox, QVBoxLayout, QWidget)

from hivekeeper.gui.services.workers import run_in_thread
from hivekeeper.gui.style import ACCENT, label


class FinetunePanel(QDialog):
    """Data file, prompts file, method and sizes, Start / Stop, a status line and the loss curve."""

    trained = Signal(str)  # the prompts file a run saved

    def __init__(self, model_of: Callable[[], str], parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Fine-tune")
        self._model_of = model_of
        self.handle = None  # the running worker
        self.losses: list[tuple[int, float]] = []  # (step, loss) of the current run
        self.error = ""
        self.steps_done: int | None = None  # the step the last finished run saved
        self._build()

    def _build(self) -> None:
        column = QVBoxLayout(self)
        # the layout never resizes the window's limits: a status line that wraps would change them after it shows,
        # which offscreen platforms warn about
        column.setSizeConstraint(QLayout.SizeConstraint.SetNoConstraint)
        self.resize(520, 600)
        form = QFormLayout()
        self.data_edit = QLineEdit()
        self.data_edit.setPlaceholderText("JSON lines of chats or prompt/completion pairs")
        browse = QPushButton("…")
        browse.clicked.connect(self._browse)
        data_row = QHBoxLayout()
        data_row.addWidget(self.data_edit, 1)
        data_row.addWidget(browse)
        self.out_edit = QLineEdit()
        self.out_edit.setPlaceholderText("the prompts file (resumed when it exists)")
        self.method_combo = QComboBox()
        self.method_combo.addItem("deep prompts (deep_ptune)", "deep_ptune")
        self.method_combo.addItem("soft prompts (ptune)", "ptune")
        self.tokens_spin = _spin(1, 256, 8)
        self.steps_spin = _spin(1, 100_000, 30)
        self.batch_spin = _spin(1, 256, 4)
        self.lr_spin = QDoubleSpinBox()
        self.lr_spin.setDecimals(4)
        self.lr_spin.setRange(0.0001, 1.0)
        self.lr_spin.setSingleStep(0.005)
        self.lr_spin.setValue(0.01)
        form.addRow("Data", data_row)
        form.addRow("Prompts file", self.out_edit)
        form.addRow("Method", self.method_combo)
        form.addRow("Prompt tokens", self.tokens_spin)
        form.addRow("Steps", self.steps_spin)
        form.addRow("Batch", self.batch_spin)
        form.addRow("Learning rate", self.lr_spin)
        column.addLayout(form)
        buttons = QHBoxLayout()
        self.start_button = QPushButton("Start")
        self.start_button.clicked.connect(self.start)
        self.stop_button = QPushButton("Stop")
        self.stop_button.clicked.connect(self.stop)
        self.stop_button.setEnabled(False)
        buttons.addWidget(self.start_button)
        buttons.addWidget(self.stop_button)
        column.addLayout(buttons)
        self.status = label("", "small", wrap=True)
        column.addWidget(self.status)
        self.plot = pg.PlotWidget()
        self.plot.setLabel("bottom", "step")
        self.plot.setLabel("left", "loss")
        self.plot.setMinimumHeight(180)
        self.curve = self.plot.plot([], [], pen=pg.mkPen(ACCENT, width=2), symbol="o", symbolSize=4)
        column.addWidget(self.plot, 1)

    def _browse(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Training data", "", "JSON lines (*.jsonl *.json);;All files (*)")
        if path:
            self.data_edit.setText(path)
            if not self.out_edit.text().strip():
                self.out_edit.setText(path.rsplit(".", 1)[0] + ".prompts")

    @property
    def busy(self) -> bool:
        return self.handle is not None and self.handle.running

    def start(self) -> bool:
        """Start (or resume) a run; False, with the reason shown, when the fields do not allow one."""
        from hivekeeper.core.finetune.trainer import RunSpec

        data, out = self.data_edit.text().strip(), self.out_edit.text().strip()
        if self.busy:
            return False
        if not data or not out:
            self.status.setText("choose a data file and where the prompts go")
            return False
        # resuming an existing prompts file goes on with its own method and size (the boxes are for a new file; session
        # 23: other values there were refused in the command line's words)
        resumes = Path(out).expanduser().is_file()
        spec = RunSpec(data=data, out=str(Path(out).expanduser()), model=self._model_of(),
                       method=None if resumes else self.method_combo.currentData(),
                       prompt_tokens=None if resumes else self.tokens_spin.value(), steps=self.steps_spin.value(),
                       lr=self.lr_spin.value(), batch=self.batch_spin.value())
        self.losses, self.error, self.steps_done = [], "", None
        self.curve.setData([], [])
        self.status.setText("loading the model…")
        self.handle = run_in_thread(lambda report, should_stop: _train(spec, report, should_stop),
                                    on_yield=self._stepped, on_return=self._done, on_error=self._failed,
                                    on_finish=self._ended)
        self.start_button.setEnabled(False)
        self.stop_button.setEnabled(True)
        return True

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.abort()
            self.status.setText("stopping after this step…")

    def _stepped(self, value) -> None:
        if isinstance(value, str):  # "resuming ... at step N"
            self.status.setText(value)
            return
        step, loss, rate, total = value
        self.losses.append((step, loss))
        self.curve.setData([s for s, _ in self.losses], [v for _, v in self.losses])
        self.status.setText(f"step {step}/{total}  loss {loss:.4f}  {rate:.0f} tokens/s")

    def _done(self, step: int) -> None:
        self.steps_done = step
        self.status.setText(f"{self.status.text()} — saved at step {step} in {self.out_edit.text().strip()}")
        self.trained.emit(self.out_edit.text().strip())

    def _failed(self, message: str) -> None:
        self.error = message
        self.status.setText(f"error: {message}")

    def _ended(self) -> None:
        self.start_button.setEnabled(True)
        self.stop_button.setEnabled(False)

    def shutdown(self) -> None:
        """Stop a run and wait for it (the window is closing)."""
        if self.handle is not None:
            self.handle.abort()
            self.handle.wait()


def _spin(low: int, high: int, value: int) -> QSpinBox:
    spin = QSpinBox()
    spin.setRange(low, high)
    spin.setValue(value)
    return spin


def _train(spec, report, should_stop) -> int:
    """The worker: open the run, train until the steps or the stop flag, save; the step saved."""
    from hivekeeper.core.finetune.trainer import close_trainer, open_trainer

    trainer, _ = open_trainer(spec, say=report)
    try:
        trainer.run(spec.out, on_step=lambda r: report((r.step, r.loss, r.tokens_per_s, spec.steps)),
                    stop=types.SimpleNamespace(is_set=should_stop))
    finally:
        close_trainer(trainer)
    return trainer.info.step
