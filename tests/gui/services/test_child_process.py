"""Child processes of the app: JSON lines in, stderr tail kept, stop escalates to SIGKILL, none outlives the app."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from hivekeeper.gui.services.child_process import JsonLinesProcess
from hivekeeper.gui.services.node import NodeLaunch, last_error

from ...child_output import ChildOutput

CHATTY = """
import json, sys, time
print("not json", flush=True)
print(json.dumps({"state": "started", "n": 1}), flush=True)
print(json.dumps({"state": "online", "n": 2}), flush=True)
print("Traceback (most recent call last):", file=sys.stderr)
print("hivekeeper serve: error: /models/x: no such checkpoint folder", file=sys.stderr, flush=True)
sys.exit(3)
"""

STUBBORN = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a child that will not stop when asked
print('{"ready": true}', flush=True)
time.sleep(120)
"""


def test_json_lines_exit_code_and_stderr_tail(qtbot):
    child = JsonLinesProcess()
    events = []
    child.event.connect(events.append)
    with qtbot.waitSignal(child.exited, timeout=30_000) as exited:
        child.start([sys.executable, "-c", CHATTY])
    code, tail = exited.args
    assert code == 3 and [e["n"] for e in events] == [1, 2]  # the line that is not JSON is skipped
    assert last_error(tail, code) == "/models/x: no such checkpoint folder"
    assert not child.running


def test_terminate_escalates_to_kill(qtbot):
    child = JsonLinesProcess()
    with qtbot.waitSignal(child.event, timeout=30_000):
        child.start([sys.executable, "-c", STUBBORN])
    pid = child.pid
    started = time.monotonic()
    with qtbot.waitSignal(child.exited, timeout=30_000):
        child.terminate(grace_ms=500)
    assert time.monotonic() - started < 20
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


APP = """
import sys, time
from PySide6.QtCore import QCoreApplication
from hivekeeper.gui.services.child_process import JsonLinesProcess
app = QCoreApplication([])
child = JsonLinesProcess()
child.start([sys.executable, "-c", "import time; time.sleep(120)"])
print(child.pid, flush=True)
time.sleep(120)
"""


def test_a_child_dies_with_the_app_even_when_the_app_is_killed():
    app = ChildOutput(subprocess.Popen([sys.executable, "-c", APP], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, env={**os.environ, "QT_QPA_PLATFORM": "offscreen"}))
    try:
        child = psutil.Process(int(app.readline(timeout=60)))
        assert child.is_running()
        app.proc.send_signal(signal.SIGKILL)  # a crash: no cleanup code runs in the app
        app.proc.wait(10)
        deadline = time.monotonic() + 10
        while not gone(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(child.pid)
    finally:
        app.close()


def gone(pid: int) -> bool:
    """True once `pid` has exited, reaping it: the orphan was adopted by this test process (tests/conftest.py makes
    it a subreaper), and a zombie left in its table would count as a child process of later tests."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:  # not (or no longer) a child of this process
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True


def test_node_launch_arguments():
    launch = NodeLaunch(model="/m", new_swarm=False, initial_peers=("/ip4/1.2.3.4/tcp/5/p2p/Qm",), num_blocks=3,
                        quant="nf4", host="127.0.0.1", public_name="me")
    argv = launch.argv()
    assert argv[:3] == [sys.executable, "-m", "hivekeeper.core.cli.main"]
    joined = " ".join(argv)
    for part in ("serve --model /m --json-status", "--quant nf4", "--initial-peers /ip4/1.2.3.4/tcp/5/p2p/Qm",
                 "--num-blocks 3", "--public-name me", "--host 127.0.0.1"):
        assert part in joined
    assert "--new-swarm" in " ".join(NodeLaunch(model="/m").argv())
