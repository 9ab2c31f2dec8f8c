"""The swarm's coverage (who serves which block, how fast), read by a watcher child process (gui/services/swarm_watch.py)."""

from __future__ import annotations

import sys

from PySide6.QtCore import QObject, Signal

from hivekeeper.gui.services.child_process import JsonLinesProcess


class CoverageService(QObject):
    """Runs one watcher at a time; emits each report (the `swarm status --json` object) and errors in words."""

    reportReceived = Signal(dict)
    errorReceived = Signal(str)

    def __init__(self, parent: QObject | None = None, period_s: float = 3.0, env: dict[str, str] | None = None):
        super().__init__(parent)
        self.period_s = period_s
        self.env = env or {}
        self.last_report: dict | None = None
        self.watching: tuple[str, tuple[str, ...]] | None = None
        self._process = JsonLinesProcess(self)
        self._process.event.connect(self._on_event)
        self._process.exited.connect(self._on_exit)

    @property
    def running(self) -> bool:
        return self._process.running

    def watch(self, model: str, initial_peers: list[str] | tuple[str, ...], dht_prefix: str | None = None) -> None:
        """Start watching a swarm (restarts the watcher if it watches another one)."""
        target = (model, tuple(initial_peers))
        if self.running and self.watching == target:
            return
        self.stop(wait=True)
        self.watching = target
        argv = [sys.executable, "-m", "hivekeeper.gui.services.swarm_watch", "--model", model,
                "--period", f"{self.period_s:g}", "--initial-peers", *initial_peers]
        if dht_prefix:
            argv += ["--dht-prefix", dht_prefix]
        self._process.start(argv, self.env)

    def stop(self, wait: bool = False) -> None:
        self.watching = None
        if wait:
            self._process.stop_blocking(5_000)
        else:
            self._process.terminate(5_000)

    def _on_event(self, event: dict) -> None:
        if event.get("event") == "report":
            self.last_report = event
            self.reportReceived.emit(event)
        elif event.get("event") == "error":
            self.errorReceived.emit(str(event.get("message", "unknown error")))

    def _on_exit(self, code: int, stderr_tail: str) -> None:
        if code not in (0, -1, 15, -15) and self.watching is not None:
            lines = [line for line in stderr_tail.splitlines() if line.strip()]
            self.errorReceived.emit(lines[-1] if lines else f"swarm watcher exited with code {code}")
