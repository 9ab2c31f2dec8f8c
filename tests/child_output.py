"""A child process's output for tests, read without ever blocking on a live pipe; the one place tests read pipes.

A read of a pipe (`readline()`, `read()`, `communicate()` without a timeout, `for line in proc.stdout`) waits until
the child writes or closes it: a child that hangs (or a grandchild that keeps the pipe open) hangs the test until
pytest's 600-s timeout, and the output that would say why is lost. Here one thread per pipe collects what the child
writes; a test waits for a pattern or a line with its own deadline, and when that passes the child is killed before
its output so far goes into the failure message. tests/test_no_blocking_pipes.py fails on a blocking read of a
pipe anywhere else in the tests.

    child = ChildOutput(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    try:
        line = child.readline(timeout=60)          # or child.wait_for(r"listening on (\\S+)", timeout=60)
    finally:
        child.close()                              # kills it when it still runs; reaps it; closes its pipes

Import it from a test module by a relative import (pytest runs with --import-mode=importlib), e.g. from
tests/core/cli/: `from ...child_output import ChildOutput`.
"""

from __future__ import annotations

import codecs
import os
import re
import subprocess
import threading
import time

STREAMS = ("stdout", "stderr")
CHUNK = 65536
JOIN_S = 5.0  # how long to wait for a reader once the child is dead (a grandchild may still hold the pipe)


class ChildOutput:
    """Collects a Popen's stdout and stderr (those that are pipes) on reader threads, as text."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.text = {name: "" for name in STREAMS}
        self.line_start = 0  # where readline() continues in stdout
        self.joined = False  # join() has waited for the readers once (after the child ended)
        self.changed = threading.Condition()
        self.readers = {name: threading.Thread(target=self.collect, args=(name, getattr(proc, name)), daemon=True)
                        for name in STREAMS if getattr(proc, name) is not None}  # stream name -> its reader
        for reader in self.readers.values():
            reader.start()

    @property
    def stdout(self) -> str:
        return self.text["stdout"]

    @property
    def stderr(self) -> str:
        return self.text["stderr"]

    def collect(self, name: str, pipe) -> None:
        """A reader thread: raw reads of the pipe's descriptor (so no buffered text is held back), decoded as UTF-8."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        while True:
            try:
                data = os.read(pipe.fileno(), CHUNK)
            except (OSError, ValueError):  # closed under us by close()
                data = b""
            with self.changed:
                self.text[name] += decoder.decode(data, final=not data)
                self.changed.notify_all()
            if not data:
                return

    def finished(self) -> bool:
        """The child has exited and every pipe reached its end."""
        return self.proc.poll() is not None and not any(reader.is_alive() for reader in self.readers.values())

    def wait_for(self, pattern: str, start: int = 0, timeout: float = 120.0, stream: str = "stdout") -> re.Match:
        """The first match of `pattern` in the stream from `start`; fails (child killed, output shown) when it has not
        appeared within `timeout` seconds or the child ended without it."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                match = regex.search(self.text[stream], start)
                if match:
                    return match
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.finished():
                    why = f"not within {timeout:g} s" if remaining <= 0 else "before the child ended"
                    break
                self.changed.wait(min(remaining, 0.5))
        raise AssertionError(f"no {pattern!r} in the child's {stream} {why}{self.report()}")

    def readline(self, timeout: float = 120.0) -> str:
        """The next whole line of stdout (with its newline); fails like wait_for."""
        match = self.wait_for(r"[^\n]*\n", self.line_start, timeout)
        self.line_start = match.end()
        return match.group(0)

    def wait(self, timeout: float = 120.0) -> int:
        """The child's exit code once it has ended and its pipes are read; fails (child killed, output shown) past
        `timeout` seconds."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the child did not exit within {timeout:g} s{self.report()}") from None
        self.join()
        return code

    def join(self, timeout: float = JOIN_S) -> None:
        """Let the readers take what is left in the pipes, once (bounded: a grandchild may keep a pipe open)."""
        deadline = time.monotonic() + (0.0 if self.joined else timeout)
        for reader in self.readers.values():
            reader.join(max(0.0, deadline - time.monotonic()))
        self.joined = True

    def stop(self) -> None:
        """Kill the child when it still runs, reap it, and collect what it wrote (bounded waits only)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(JOIN_S)
        self.join()

    def report(self) -> str:
        """The child's output so far, for a failure message (the child is stopped first)."""
        self.stop()
        with self.changed:
            return (f" (exit code {self.proc.returncode})\n--- stdout ---\n{self.text['stdout']}"
                    f"\n--- stderr ---\n{self.text['stderr']}")

    def close(self) -> None:
        """stop(), then close stdin and the pipes whose reader is done. A pipe a grandchild still holds open stays
        open: closing it under its blocked reader could hand the descriptor's number to another file it would read."""
        self.stop()
        done = [name for name, reader in self.readers.items() if not reader.is_alive()]
        for pipe in [self.proc.stdin] + [getattr(self.proc, name) for name in done]:
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass


def run(command: list[str], timeout: float, input: str | None = None, **popen_args) -> subprocess.CompletedProcess:
    """subprocess.run(command, input=..., capture_output=True, text=True, timeout=...), except that a timeout fails
    the test with the output so far (the child killed first) rather than raising TimeoutExpired without it."""
    stdin = subprocess.PIPE if input is not None else subprocess.DEVNULL
    child = ChildOutput(subprocess.Popen(command, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         **popen_args))
    if input is not None:  # written by a thread: a child that reads nothing must not block the test
        threading.Thread(target=write_and_close, args=(child.proc.stdin, input.encode()), daemon=True).start()
    try:
        code = child.wait(timeout)
    finally:
        child.close()
    return subprocess.CompletedProcess(command, code, child.stdout, child.stderr)


def write_and_close(pipe, data: bytes) -> None:
    """Write all of data to a child's stdin, then close it (end of input); a child that exits early is no error."""
    try:
        pipe.write(data)
        pipe.close()
    except (OSError, ValueError):
        pass
