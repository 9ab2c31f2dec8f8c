"""A child process that reports one JSON object per stdout line, wrapped in a QObject (no threads: QProcess).

The child runs in its own session (process group), so stopping it can also take down what it started (hivemind's
p2pd daemon) even if the child itself dies badly; on Linux it also gets SIGTERM if the app itself dies. stderr is
kept as a short tail for error messages.

`ChildService` is the part the app's child-process services share (the node, the API): one JsonLinesProcess, a
state with a stateChanged signal, running and pid; `last_error` picks the line of a dead child's stderr that says
what went wrong.

Stopping a child always ends with it reaped (`end_process`): a child still running, or dead but not yet waited for,
when the app exits is adopted by init (or a subreaper, such as a test runner) and lingers there as a zombie.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import sys
import time

from PySide6.QtCore import QObject, QProcess, QProcessEnvironment, QTimer, Signal

from hivekeeper.core.child_argv import die_with_parent

REAP_S = 30.0  # after SIGKILL, how long to wait for the kernel to end the process (seconds on a loaded machine)


def end_process(process: QProcess, grace_ms: int = 0) -> bool:
    """Stop a QProcess and reap it: SIGTERM and up to grace_ms to exit (0: none), then SIGKILL and wait until it
    has ended. Qt emits `finished` on the way. True when it has ended (always, short of a process the kernel cannot
    kill)."""
    if process.state() == QProcess.ProcessState.NotRunning:
        return True
    if grace_ms > 0:
        process.terminate()
        if process.waitForFinished(grace_ms):
            return True
    process.kill()
    deadline = time.monotonic() + REAP_S
    while process.state() != QProcess.ProcessState.NotRunning and time.monotonic() < deadline:
        process.waitForFinished(500)
    return process.state() == QProcess.ProcessState.NotRunning


class JsonLinesProcess(QObject):
    """One child process at a time. Signals: event(dict) per JSON line, exited(code, stderr tail) once it ends."""

    event = Signal(dict)
    exited = Signal(int, str)
    stderrLine = Signal(str)

    def __init__(self, parent: QObject | None = None, stderr_lines: int = 200):
        super().__init__(parent)
        self._process: QProcess | None = None
        self._stderr = collections.deque(maxlen=stderr_lines)
        self._stderr_partial = b""
        self._pid: int | None = None
        self._kill_timer = QTimer(self)
        self._kill_timer.setSingleShot(True)
        self._kill_timer.timeout.connect(self.kill)

    # ---- state -----------------------------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._process is not None and self._process.state() != QProcess.ProcessState.NotRunning

    @property
    def pid(self) -> int | None:
        return self._pid

    def stderr_tail(self, lines: int = 20) -> str:
        return "\n".join(list(self._stderr)[-lines:])

    # ---- start / stop ----------------------------------------------------------------------------------------------
    def start(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        if self.running:
            raise RuntimeError("the child process is already running")
        self._stderr.clear()
        self._stderr_partial = b""
        process = QProcess(self)
        argv = die_with_parent(argv)
        process.setProgram(argv[0])
        process.setArguments(argv[1:])
        environment = QProcessEnvironment.systemEnvironment()
        for key, value in (env or {}).items():
            environment.insert(key, value)
        process.setProcessEnvironment(environment)
        # a session of its own: killpg then reaches the daemons it spawns; its stdin stays open (watchers exit on
        # EOF, so they never outlive the app)
        if sys.platform != "win32":
            process.setUnixProcessParameters(QProcess.UnixProcessFlag.CreateNewSession)
        process.readyReadStandardOutput.connect(self._read_stdout)
        process.readyReadStandardError.connect(self._read_stderr)
        process.finished.connect(self._finished)
        process.errorOccurred.connect(self._error)
        self._process = process
        process.start()
        if process.waitForStarted(10_000):
            self._pid = int(process.processId())

    def send(self, message: dict) -> bool:
        """Write one JSON line to the child's stdin (its control channel); False when no child runs."""
        if not self.running:
            return False
        self._process.write((json.dumps(message) + "\n").encode())
        return True

    def terminate(self, grace_ms: int = 20_000) -> None:
        """Ask the child to stop (SIGTERM); SIGKILL its whole group if it is still there after grace_ms."""
        if not self.running:
            return
        self._process.closeWriteChannel()
        self._process.terminate()
        self._kill_timer.start(grace_ms)

    def stop_blocking(self, grace_ms: int = 20_000) -> None:
        """terminate() and wait for the end (for closing the app): the child is reaped when this returns; its group
        is killed after grace_ms, and once it has ended (a daemon it left behind)."""
        process = self._process
        if process is not None and self.running:
            self._kill_timer.stop()
            process.closeWriteChannel()
            if process.state() == QProcess.ProcessState.Running:
                process.terminate()
                if not process.waitForFinished(grace_ms):
                    self._kill_group()
            end_process(process)
        self._kill_group()

    def kill(self) -> None:
        """SIGKILL the child and everything in its process group."""
        self._kill_group()
        if self.running:
            self._process.kill()

    def _kill_group(self) -> None:
        if self._pid is None or sys.platform == "win32":
            return
        try:
            os.killpg(self._pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    # ---- output ----------------------------------------------------------------------------------------------------
    def _read_stdout(self) -> None:
        process = self._process
        while process is not None and process.canReadLine():
            line = bytes(process.readLine()).decode("utf-8", errors="replace").strip()
            if not line.startswith("{"):
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                self.event.emit(event)

    def _read_stderr(self) -> None:
        if self._process is None:
            return
        data = self._stderr_partial + bytes(self._process.readAllStandardError())
        *lines, self._stderr_partial = data.split(b"\n")
        for raw in lines:
            line = raw.decode("utf-8", errors="replace").rstrip()
            if line:
                self._stderr.append(line)
                self.stderrLine.emit(line)

    def _finished(self, code: int, status) -> None:
        self._kill_timer.stop()
        self._read_stdout()
        self._read_stderr()
        if self._stderr_partial.strip():
            self._stderr.append(self._stderr_partial.decode("utf-8", errors="replace"))
            self._stderr_partial = b""
        self._kill_group()  # a daemon the child left behind goes with it
        if status == QProcess.ExitStatus.CrashExit:
            code = -1  # killed by a signal: Qt's exit code means nothing then
        process, self._process = self._process, None
        if process is not None:
            process.deleteLater()
        self.exited.emit(int(code), self.stderr_tail())

    def _error(self, error) -> None:
        if error == QProcess.ProcessError.FailedToStart and self._process is not None:
            self._stderr.append(f"cannot start {self._process.program()}: {self._process.errorString()}")
            process, self._process = self._process, None
            process.deleteLater()
            self.exited.emit(-1, self.stderr_tail())


def last_error(stderr_tail: str, code: int, who: str = "the node") -> str:
    """The line of a dead child's stderr that says what went wrong (the CLI's one-line error, else the exception)."""
    lines = [line.strip() for line in stderr_tail.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("hivekeeper ") and ": error: " in line:
            return line.split(": error: ", 1)[1]
    for line in reversed(lines):
        if "Error" in line or "error" in line or "Exception" in line:
            return line
    if lines:
        return lines[-1]
    return f"{who} exited with code {code}"


class ChildService(QObject):
    """One JSON-lines child with a named state: subclasses connect `_on_event` and `_on_exit` and set states."""

    stateChanged = Signal(str)

    def __init__(self, parent: QObject | None = None, env: dict[str, str] | None = None):
        super().__init__(parent)
        self.env = env or {}
        self.state = "stopped"
        self.error = ""
        self._process = JsonLinesProcess(self)
        self._process.event.connect(self._on_event)
        self._process.exited.connect(self._on_exit)

    @property
    def running(self) -> bool:
        return self._process.running

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process.running else None

    def _on_event(self, event: dict) -> None:
        raise NotImplementedError

    def _on_exit(self, code: int, stderr_tail: str) -> None:
        raise NotImplementedError

    def _set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self.stateChanged.emit(state)
