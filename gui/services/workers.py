"""Background work off the GUI thread: a function run on a QThread, reporting through Qt signals.

The worker shape follows superqt/napari workers: `started`, `yielded(value)` for each intermediate result,
`returned(value)` when the function completes, `errored(message)` when it raises, and `finished` always last.
The function is called as `func(report, should_stop)`: `report(value)` emits `yielded`, `should_stop()` is the
abort flag, which long loops check between steps (between tokens, between benchmarks).

The callbacks given to `run_in_thread` always run on the GUI thread, whatever they are: PySide queues a signal to
a bound method of a QObject, but calls a lambda or a plain function on the emitting (worker) thread, where touching
a widget starts its timers from the wrong thread ("QBasicTimer::start: Timers cannot be started from another
thread"). So the worker's signals reach the callbacks through a `_Relay` QObject made on the GUI thread. Workers
are started from the GUI thread only (`start` raises otherwise), so their QObjects belong to it. While a worker runs,
Python's cyclic garbage is collected on the GUI thread only (collector.py), as it is while a window is open: a
collection the worker's allocations set off would destroy Qt objects held in cycles on the worker.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable

from PySide6.QtCore import QCoreApplication, QObject, Qt, QThread, Signal, Slot

from hivekeeper.planner.errors import InputError

from hivekeeper.gui.services.collector import GuiThreadCollector

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


def require_gui_thread() -> None:
    app = QCoreApplication.instance()
    if app is not None and QThread.currentThread() is not app.thread():
        raise RuntimeError("a worker is started from the GUI thread only (its callbacks and QObjects live there)")


class WorkerThread:
    """A Worker on its own QThread; keeps both alive until the thread ends. Connect signals before `start()`."""

    _alive: set["WorkerThread"] = set()  # a QThread must outlive its thread: handles are held here until then

    def __init__(self, func: Callable[[Report, ShouldStop], Any]):
        self.worker = Worker(func)
        self.relay: QObject | None = None  # run_in_thread's _Relay, which calls the callbacks on the GUI thread
        self.thread = QThread()
        self.worker.moveToThread(self.thread)
        self.thread.started.connect(self.worker.run)
        # direct: the thread must end even while the GUI thread is blocked waiting for it (queued would deadlock)
        self.worker.finished.connect(self.thread.quit, Qt.ConnectionType.DirectConnection)

    def start(self) -> "WorkerThread":
        require_gui_thread()
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


class _Relay(QObject):
    """Calls a worker's callbacks on the thread it was made on (the GUI thread): its slots are bound methods of a
    QObject, so the worker's signals are queued to them. It keeps itself alive until `finished` (the last signal)
    has been delivered, so no queued callback is lost when its handle is dropped first."""

    _pending: set["_Relay"] = set()

    def __init__(self, handle: WorkerThread, on_yield, on_return, on_error, on_finish):
        super().__init__()
        _Relay._pending.add(self)
        self._collector = GuiThreadCollector(self)  # until the worker has finished
        self._callbacks = {"yield": on_yield, "return": on_return, "error": on_error, "finish": on_finish}
        worker = handle.worker
        if on_yield is not None:
            worker.yielded.connect(self._yielded)
        if on_return is not None:
            worker.returned.connect(self._returned)
        if on_error is not None:
            worker.errored.connect(self._errored)
        worker.finished.connect(self._finished)

    def _yielded(self, value) -> None:
        self._callbacks["yield"](value)

    def _returned(self, value) -> None:
        self._callbacks["return"](value)

    def _errored(self, message: str) -> None:
        self._callbacks["error"](message)

    def _finished(self) -> None:
        _Relay._pending.discard(self)
        self._collector.stop()
        if self._callbacks["finish"] is not None:
            self._callbacks["finish"]()


def run_in_thread(func: Callable[[Report, ShouldStop], Any], *, on_yield=None, on_return=None, on_error=None,
                  on_finish=None) -> WorkerThread:
    """Start func on a worker thread with the given callbacks, called on the GUI thread (any callable: a lambda
    too) through the handle's `_Relay`."""
    require_gui_thread()  # before the relay (and its collector) is made
    handle = WorkerThread(func)
    handle.relay = _Relay(handle, on_yield, on_return, on_error, on_finish)
    return handle.start()
