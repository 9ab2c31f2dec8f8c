"""A batch generation of the plan shown ("Run this plan" on the Plan page) on a worker thread, with Stop.

The worker runs core.offload.batch_run.run_batch (what `hivekeeper generate --prompts-file` runs, with the page's
policy) and reports `planned(info)` once the run's shape and prediction are known, `step(StepReport)` as tokens
come, then `finished(report)` or `errored(message)`, and `ended` always last. Stop sets the event the generation loop checks between steps, so the run ends after the
step in progress and its report says `stopped`. torch is imported on the worker only.
"""

from __future__ import annotations

import threading

from PySide6.QtCore import QObject, Signal

from hivekeeper.gui.services.workers import WorkerThread, run_in_thread


class BatchRunService(QObject):
    planned = Signal(dict)  # batch, prompt and new tokens, the predicted figures, the plan in words
    step = Signal(object)  # core.offload.batch_run.StepReport
    finished = Signal(dict)  # run_batch's report
    errored = Signal(str)
    ended = Signal()

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self._stop = threading.Event()
        self._job: WorkerThread | None = None

    @property
    def busy(self) -> bool:
        return self._job is not None and self._job.running

    def start(self, run) -> bool:
        """Start a run (a core.offload.batch_run.BatchRun); False (nothing started) while one is running."""
        if self.busy:
            return False
        self._stop.clear()
        stop = self._stop

        def work(report, should_stop) -> dict:
            from hivekeeper.core.offload.batch_run import run_batch

            return run_batch(run, on_step=report, stop=stop, on_start=report)

        # bound methods of this QObject: called on the GUI thread (queued), as workers.run_in_thread says
        self._job = run_in_thread(work, on_yield=self._stepped, on_return=self._returned, on_error=self._failed,
                                  on_finish=self._ended)
        return True

    def _stepped(self, report) -> None:
        if isinstance(report, dict):  # on_start's info
            self.planned.emit(report)
        else:
            self.step.emit(report)

    def _returned(self, report: dict) -> None:
        self.finished.emit(report)

    def _failed(self, message: str) -> None:
        self.errored.emit(message)

    def _ended(self) -> None:
        self.ended.emit()

    def stop(self) -> None:
        """End the run after the step in progress."""
        self._stop.set()
        if self._job is not None:
            self._job.abort()

    def wait(self, ms: int = 60_000) -> bool:
        """Block until the worker ends (shutdown, tests); True when it did."""
        return self._job is None or self._job.wait(ms)

    def shutdown(self) -> None:
        self.stop()
        self.wait()
