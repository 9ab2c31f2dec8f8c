"""The Plan page's "Run this plan" box: a batch generation over a prompts file with the plan shown, and its measured
throughput drawn against the predicted one as it runs.

The page hands in `make_run(prompts_file, max_new_tokens) -> core.offload.batch_run.BatchRun` (its model, policy and
predicted figures; an InputError says why this plan cannot run here). The run goes on a worker
(services.batch_run.BatchRunService); each step adds a point (seconds since the start, tokens/s so far, prefill
included: the throughput the planner predicts) to the measured curve, beside the predicted line. Stop ends it after
the step in progress.
"""

from __future__ import annotations

from typing import Callable

import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import (QFileDialog, QGroupBox, QHBoxLayout, QLineEdit, QPushButton, QSpinBox,
                               QVBoxLayout, QWidget)

from hivekeeper.planner.errors import InputError

from hivekeeper.core.offload.local_plan import ENGINE_NOTE_KEY

from hivekeeper.gui.services.batch_run import BatchRunService
from hivekeeper.gui.widgets.chart import Chart
from hivekeeper.gui.style import ACCENT, BAD, GOOD, MUTED, fmt_rate, label


REDRAW_MS = 100  # steps of a small model come every few ms: the chart is redrawn at most this often


def empty_note(machine: str | None) -> str:
    """What the chart says before a run has measured anything; `machine` is a catalog machine's name, None for this
    machine (a run always runs here)."""
    if machine is None:
        return ("Nothing measured yet: Run this plan runs it on this machine and draws the measured tokens/s here "
                "beside the prediction.")
    return (f"No measurement for {machine}: it is a catalog machine, planned from its spec sheet. Run this plan "
            "runs the plan on this machine and draws what it measures here.")


class RunPlanBox(QGroupBox):
    """Prompts file, tokens per prompt, Run / Stop and a status line; `plot`, the predicted-vs-measured chart."""

    def __init__(self, make_run: Callable[[str, int], object], parent: QWidget | None = None):
        super().__init__("Run this plan", parent)
        self._make_run = make_run
        self.service = BatchRunService(self)
        self.predicted: float | None = None
        self.engine_note = ""  # why the prediction is of another dtype than the plan names, where it is
        self.points: list[tuple[float, float]] = []  # (seconds, measured tokens/s) per step
        self.report: dict | None = None  # the last finished run's report
        self.last_run = None  # the BatchRun last started
        self.error = ""
        self._last_step = None
        self._machine: str | None = None  # the page's catalog machine, None for this one
        self._redraw = QTimer(self)
        self._redraw.setSingleShot(True)
        self._redraw.setInterval(REDRAW_MS)
        self._redraw.timeout.connect(self._draw)
        self._build()
        self.service.planned.connect(self._planned)
        self.service.step.connect(self._stepped)
        self.service.finished.connect(self._finished)
        self.service.errored.connect(self._failed)
        self.service.ended.connect(self._ended)

    def _build(self) -> None:
        """The controls in this box (narrow: the Plan page's knob column); the chart is `plot`, for the page to
        place beside its other charts."""
        column = QVBoxLayout(self)
        files = QHBoxLayout()
        self.prompts_edit = QLineEdit()
        self.prompts_edit.setPlaceholderText("prompts file (one a line, equal lengths)")
        self.browse_button = QPushButton("Prompts…")
        self.browse_button.clicked.connect(self._browse)
        files.addWidget(self.prompts_edit, 1)
        files.addWidget(self.browse_button)
        column.addLayout(files)
        actions = QHBoxLayout()
        self.tokens_spin = QSpinBox()
        self.tokens_spin.setRange(1, 100_000)
        self.tokens_spin.setValue(32)
        self.tokens_spin.setSuffix(" tokens each")
        self.run_button = QPushButton("Run this plan")
        self.stop_button = QPushButton("Stop")
        self.stop_button.setEnabled(False)
        self.run_button.clicked.connect(self.run)
        self.stop_button.clicked.connect(self.stop)
        for widget in (self.tokens_spin, self.run_button, self.stop_button):
            actions.addWidget(widget)
        column.addLayout(actions)
        self.status = label("Runs the plan shown on a batch of prompts, here, and draws what it measures.", "small",
                            wrap=True)
        column.addWidget(self.status)
        self.plot = Chart()
        self.plot.setTitle("predicted vs measured", color=MUTED, size="10pt")
        self.plot.setLabel("bottom", "seconds since the start")
        self.plot.setLabel("left", "tokens/s")
        self.plot.showGrid(x=True, y=True, alpha=0.2)
        self.plot.setMenuEnabled(False)
        self.plot.setMinimumHeight(180)
        self.plot.setLimits(yMin=0)
        self.plot.getAxis("left").enableAutoSIPrefix(False)
        self.plot.legend_below()
        self.predicted_curve = self.plot.plot([], [], pen=pg.mkPen(BAD, width=1, style=Qt.PenStyle.DashLine),
                                              name="predicted")
        self.measured_curve = self.plot.plot([], [], pen=pg.mkPen(ACCENT, width=2), name="measured",
                                             symbol="o", symbolSize=4, symbolBrush=ACCENT)
        self.plot.show_note(empty_note(None))

    def set_machine(self, machine: str | None) -> None:
        """The machine the page plans for (a catalog name, None for this one): the empty chart's note names it."""
        self._machine = machine
        if not self.points:
            self.plot.show_note(empty_note(machine))

    # ---- actions -----------------------------------------------------------------------------------------------------
    def _browse(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Prompts file", "", "Text files (*.txt);;All files (*)")
        if path:
            self.prompts_edit.setText(path)

    def run(self) -> bool:
        """Start a run of the plan shown; False (with the reason on the status line) when it cannot start."""
        if self.service.busy:
            return False
        try:
            run = self._make_run(self.prompts_edit.text().strip(), self.tokens_spin.value())
        except InputError as exc:
            self._say(str(exc), BAD)
            return False
        self.report, self.error, self.points, self._last_step = None, "", [], None
        self.predicted = (run.predicted or {}).get("throughput_tokens_per_s")
        self.engine_note = (run.predicted or {}).get(ENGINE_NOTE_KEY, "")
        self.measured_curve.setData([], [])
        self.predicted_curve.setData([], [])
        self.plot.show_note("Running: the first step's measurement comes here.")
        self.last_run = run
        self.service.start(run)
        self.run_button.setEnabled(False)
        self.stop_button.setEnabled(True)
        self._say("loading the model…", MUTED)
        return True

    def stop(self) -> None:
        if self.service.busy:
            self.service.stop()
            self._say("stopping after this step…", MUTED)

    # ---- the run's signals -------------------------------------------------------------------------------------------
    def _planned(self, info: dict) -> None:
        """The run's shape is known: the prediction for it replaces the page's (made for the typed lengths)."""
        self.predicted = (info.get("predicted") or {}).get("throughput_tokens_per_s", self.predicted)
        self.engine_note = (info.get("predicted") or {}).get(ENGINE_NOTE_KEY, "")
        self._say(f"loading the model: {info['batch']} prompts of {info['prompt_tokens']} tokens, "
                  f"{info['new_tokens']} new tokens each{self._against()}; {info['plan']}", MUTED)

    def _stepped(self, report) -> None:
        self.points.append((report.elapsed_s, report.throughput_tokens_per_s))
        self._last_step = report
        if not self._redraw.isActive():
            self._redraw.start()

    def _draw(self) -> None:
        """The chart and the status line as of the last step."""
        report = self._last_step
        if report is None or not self.points:
            return
        xs, ys = zip(*self.points)
        self.plot.hide_note()
        self.measured_curve.setData(list(xs), list(ys))
        if self.predicted is not None:
            self.predicted_curve.setData([0.0, max(xs)], [self.predicted, self.predicted])
        self._say(f"step {report.step}: {report.tokens} tokens, measured {fmt_rate(ys[-1])} tokens/s"
                  f"{self._against()}", MUTED)

    def _against(self) -> str:
        if self.predicted is None:
            return " (the plan has no prediction)"
        # a prediction of another dtype than the plan names says why (costmodel.evaluate_as_run)
        note = f" ({self.engine_note})" if self.engine_note else ""
        return f" against {fmt_rate(self.predicted)} predicted{note}"

    def _finished(self, report: dict) -> None:
        self._redraw.stop()
        self._draw()
        self.report = report
        measured = report.get("throughput_tokens_per_s")
        ratio = (f" ({measured / self.predicted:.2f}× the prediction)"
                 if measured and self.predicted else "")
        how = "stopped" if report.get("stopped") else "done"
        self._say(f"{how}: {report['new_tokens']} tokens for {report['batch']} prompts in {report['total_s']:.2f} s, "
                  f"{fmt_rate(measured)} tokens/s measured{self._against()}{ratio}; {report['plan']}", GOOD)

    def _failed(self, message: str) -> None:
        self.error = message
        self._say(message, BAD)
        if not self.points:
            self.plot.show_note(f"The run measured nothing: {message.splitlines()[0] if message else 'it failed'}")

    def _ended(self) -> None:
        self.run_button.setEnabled(True)
        self.stop_button.setEnabled(False)

    def _say(self, text: str, color: str) -> None:
        self.status.setText(text)
        self.status.setStyleSheet(f"color: {color};")

    def shutdown(self) -> None:
        self._redraw.stop()
        self.service.shutdown()
