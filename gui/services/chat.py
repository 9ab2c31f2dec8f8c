"""Chat generation on a worker thread: started / yielded(text) / finished(stats) / errored(message), and Stop.

The backend (the loaded model, local or through the swarm) is created on the worker the first time it is needed
and kept for the next replies; asking for another model or mode closes it and loads the new one. Stop sets a flag
the generation loop checks between tokens, so a reply stops after at most one more token.
"""

from __future__ import annotations

import threading
import time

from PySide6.QtCore import QObject, Signal

from hivekeeper.planner.hardware import HardwareSpec

from hivekeeper.gui.services.workers import WorkerThread, run_in_thread


class ChatService(QObject):
    started = Signal()
    status = Signal(str)  # what the worker is doing before the first token ("loading the model…")
    yielded = Signal(str)  # a piece of the reply, final (never retracted)
    finished = Signal(dict)  # stats of the reply: tokens, tokens_per_s, finish_reason, ...
    errored = Signal(str)
    kernels = Signal(str)  # the CPU kernels' warm-up (prepare_kernels): its COMPILING words, then how long it took

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self.hardware: HardwareSpec | None = None  # for the local placement (set by the window)
        self.efficiency = None  # its cost-model factors (planner MachineEfficiency), None for the defaults
        self._backend = None  # lives on worker threads; only one reply runs at a time
        self._stop = threading.Event()
        self._job: WorkerThread | None = None
        self._kernels_job: WorkerThread | None = None
        self.placement = ""

    @property
    def busy(self) -> bool:
        return self._job is not None and self._job.running

    def send(self, key, request) -> None:
        """Start a reply (chat_backends.BackendKey, chat_backends.Request). Ignored while one is running."""
        if self.busy:
            return
        self._stop.clear()
        stop, hardware, efficiency = self._stop, self.hardware, self.efficiency

        def work(report, should_stop) -> dict:
            from hivekeeper.gui.services import chat_backends

            backend = self._backend
            if backend is None or backend.key != key:
                if backend is not None:
                    self._backend = None
                    backend.close()
                report(("status", "loading the model…"))
                backend = chat_backends.ChatBackend(key, hardware, lambda words: report(("status", words)),
                                                    efficiency)
                self._backend = backend
                report(("placement", backend.placement))
            report(("status", "thinking…"))
            started = time.perf_counter()
            result = backend.reply(request, lambda text: report(("text", text)), stop)
            stats = result.as_dict()
            stats["wall_s"] = time.perf_counter() - started
            stats["finish_reason"] = result.finish_reasons[0]
            return stats

        self._job = run_in_thread(work, on_yield=self._on_yield, on_return=self._on_return, on_error=self._on_error)
        self.started.emit()

    def prepare_kernels(self) -> None:
        """Compile (the first run after an install: 10-20 s) and load the CPU decode kernels on a worker, once,
        before the first reply waits for them; `kernels` says what happens. A reply sent meanwhile waits for the
        same compile (native_kernels' lock) and says so in its status."""
        if self._kernels_job is not None:
            return

        def work(report, should_stop) -> str:
            from hivekeeper.core.runtime.kernels.native_kernels import load_saying

            seconds = load_saying(report)
            return "" if seconds is None else f"CPU decode kernels compiled in {seconds:.0f} s."

        self._kernels_job = run_in_thread(work, on_yield=self.kernels.emit, on_return=self.kernels.emit,
                                          on_error=self.kernels.emit)

    def stop(self) -> None:
        """Stop the running reply after the current token."""
        self._stop.set()
        if self._job is not None:
            self._job.abort()

    def wait(self, ms: int = 60_000) -> bool:
        return self._job.wait(ms) if self._job is not None else True

    def shutdown(self) -> None:
        """Stop any reply and free the model (its p2pd too, for the swarm backend)."""
        self.stop()
        self.wait()
        if self._kernels_job is not None:
            self._kernels_job.wait(120_000)  # a compile cannot be stopped; it ends within seconds
        backend, self._backend = self._backend, None
        if backend is not None:
            backend.close()

    def _on_return(self, stats: dict) -> None:
        self.finished.emit(stats)

    def _on_error(self, message: str) -> None:
        self.errored.emit(message)

    def _on_yield(self, item) -> None:
        kind, value = item
        if kind == "text":
            self.yielded.emit(value)
        elif kind == "placement":
            self.placement = value
            self.status.emit(value)
        else:
            self.status.emit(value)
