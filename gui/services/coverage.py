"""The swarm's coverage (who serves which block, how fast), read by a watcher child process (gui/services/swarm_watch.py);
and the swarm's models (the registry, each model's coverage, where this machine would help), read by a second one."""

from __future__ import annotations

import sys

from PySide6.QtCore import QObject, Signal

from hivekeeper.gui.services.child_process import JsonLinesProcess


class CoverageService(QObject):
    """Runs one watcher at a time; emits each report (the `swarm status --json` object) and errors in words."""

    reportReceived = Signal(dict)
    errorReceived = Signal(str)
    directoryReceived = Signal(dict)  # {"models": [...], "best": prefix or None}
    directoryError = Signal(str)

    def __init__(self, parent: QObject | None = None, period_s: float = 3.0, env: dict[str, str] | None = None):
        super().__init__(parent)
        self.period_s = period_s
        self.env = env or {}
        self.last_report: dict | None = None
        self.watching: tuple[str, tuple[str, ...]] | None = None
        self._process = JsonLinesProcess(self)
        self._process.event.connect(self._on_event)
        self._process.exited.connect(self._on_exit)
        self.directory_peers: tuple[str, ...] | None = None
        self.directory_period_s = 10.0  # the models list is read again this often
        self._directory = JsonLinesProcess(self)
        self._directory.event.connect(self._on_directory_event)
        self._directory.exited.connect(self._on_directory_exit)

    @property
    def running(self) -> bool:
        return self._process.running

    def watch(self, model: str, initial_peers: list[str] | tuple[str, ...], dht_prefix: str | None = None) -> None:
        """Start watching a swarm (restarts the watcher if it watches another one)."""
        target = (model, tuple(initial_peers))
        if self.running and self.watching == target:
            return
        self.watching = None
        self._process.stop_blocking(5_000)
        self.watching = target
        argv = [sys.executable, "-m", "hivekeeper.gui.services.swarm_watch", "--model", model,
                "--period", f"{self.period_s:g}", "--initial-peers", *initial_peers]
        if dht_prefix:
            argv += ["--dht-prefix", dht_prefix]
        self._process.start(argv, self.env)

    def stop(self, wait: bool = False) -> None:
        """Stop both watchers (the coverage one and the models one)."""
        self.watching = None
        self.directory_peers = None
        for process in (self._process, self._directory):
            if wait:
                process.stop_blocking(5_000)
            else:
                process.terminate(5_000)

    def watch_directory(self, initial_peers: list[str] | tuple[str, ...]) -> None:
        """Start listing the models of the swarm at these peers (restarts the lister if it lists another swarm)."""
        peers = tuple(initial_peers)
        if self._directory.running and self.directory_peers == peers:
            return
        self.directory_peers = None
        self._directory.stop_blocking(5_000)
        self.directory_peers = peers
        argv = [sys.executable, "-m", "hivekeeper.gui.services.swarm_watch", "--directory", "--period",
                f"{self.directory_period_s:g}", "--initial-peers", *peers]
        self._directory.start(argv, self.env)

    @property
    def directory_running(self) -> bool:
        return self._directory.running

    def _on_directory_event(self, event: dict) -> None:
        if self.directory_peers is None:
            return  # read before it was stopped
        if event.get("event") == "directory":
            self.directoryReceived.emit(event)
        elif event.get("event") == "error":
            self.directoryError.emit(str(event.get("message", "unknown error")))

    def _on_directory_exit(self, code: int, stderr_tail: str) -> None:
        if code not in (0, 2, -1, 15, -15) and self.directory_peers is not None:
            lines = [line for line in stderr_tail.splitlines() if line.strip()]
            self.directoryError.emit(lines[-1] if lines else f"the swarm's model list stopped (code {code})")

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
