"""Background work off the GUI thread: a function run on a QThread, reporting through Qt signals.

The worker shape follows superqt/napari workers: `started`, `yielded(value)` for each intermediate result,
`returned(value)` when the function completes, `errored(message)` when it raises, and `finished` always last.
The function is called as `func(report, should_stop)`: `report(value)` emits `yielded`, `should_stop()` is the
abort flag, which long loops check between steps (between tokens, between benchmarks).
"""

from __future__ import annotations

import traceback
from typing import Any, Callable

from PySide6.QtCore import QObject, Qt, QThread, Signal, Slot

from hivekeeper.planner.errors import InputError

Report = Callable[[Any], None]
ShouldStop = Callable[[], bool]


class Worker(QObject):
    started = Signal()
    yielded = Signal(object)
    returned = Signal(object)
    errored = Signal(str)
    finished = Signal()

    def __init__(self, func: Callable[[Report, ShouldStop], Any]):
        super().__init__()
        self._func = func
        self._abort = False
        self.error: str | None = None
        self.result: Any = None
        self.done = False

    def abort(self) -> None:
        """Ask the function to stop at its next check (thread-safe: a plain flag)."""
        self._abort = True

    @property
    def aborted(self) -> bool:
        return self._abort

    @Slot()
    def run(self) -> None:
        self.started.emit()
        try:
            self.result = self._func(self.yielded.emit, lambda: self._abort)
            self.returned.emit(self.result)
        except InputError as exc:
            self.error = str(exc)
            self.errored.emit(self.error)
        except Exception as exc:  # shown to the user; the traceback goes to stderr for bug reports
            traceback.print_exc()
            self.error = f"{type(exc).__name__}: {exc}"
            self.errored.emit(self.error)
        finally:
            self.done = True
            self.finished.emit()


class WorkerThread:
    """A Worker on its own QThread; keeps both alive until the thread ends. Connect signals before `start()`."""

    _alive: set["WorkerThread"] = set()  # a QThread must outlive its thread: handles are held here until then

    def __init__(self, func: Callable[[Report, ShouldStop], Any]):
        self.worker = Worker(func)
        self.thread = QThread()
        self.worker.moveToThread(self.thread)
        self.thread.started.connect(self.worker.run)
        # direct: the thread must end even while the GUI thread is blocked waiting for it (queued would deadlock)
        self.worker.finished.connect(self.thread.quit, Qt.ConnectionType.DirectConnection)

    def start(self) -> "WorkerThread":
        # Drop handles of threads that have fully ended. (Dropping one from its own `finished` signal would
        # destroy the QThread while it is still winding down, which Qt reports and may crash on.)
        WorkerThread._alive -= {h for h in WorkerThread._alive if h.thread.isFinished()}
        WorkerThread._alive.add(self)
        self.thread.start()
        return self

    def abort(self) -> None:
        self.worker.abort()

    @property
    def running(self) -> bool:
        return self.thread.isRunning()

    def wait(self, ms: int = 30_000) -> bool:
        """Block until the thread ends (for shutdown and tests); True when it did."""
        return self.thread.wait(ms)

    @classmethod
    def stop_all(cls, ms: int = 60_000) -> bool:
        """Abort every running worker and wait for them (app shutdown); True when all ended in time."""
        for handle in list(cls._alive):
            handle.abort()
        return all(handle.wait(ms) for handle in list(cls._alive))


def run_in_thread(func: Callable[[Report, ShouldStop], Any], *, on_yield=None, on_return=None, on_error=None,
                  on_finish=None) -> WorkerThread:
    """Start func on a worker thread with the given callbacks (called on the GUI thread via queued signals)."""
    handle = WorkerThread(func)
    if on_yield is not None:
        handle.worker.yielded.connect(on_yield)
    if on_return is not None:
        handle.worker.returned.connect(on_return)
    if on_error is not None:
        handle.worker.errored.connect(on_error)
    if on_finish is not None:
        handle.worker.finished.connect(on_finish)
    return handle.start()
