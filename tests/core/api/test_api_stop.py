"""Ctrl-C on `hivekeeper api` (a real subprocess on the real default model) while requests are being generated: the
server cancels them first and stops quietly, with no traceback and no "Exception in ASGI application" on stderr (it
used to wait out uvicorn's 10-s graceful timeout, then cancel the handlers with a traceback each), says it stopped,
and the clients get an answer that says the reply was cut short."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from hivekeeper.core.runtime.default_model import default_model_file

from ...child_output import ChildOutput
from .raw_http import send_request

pytestmark = pytest.mark.skipif(default_model_file() is None,
                                reason="the default model is not installed (make run installs it)")

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
DEADLINE_S = 120
LOAD_DEADLINE_S = 240  # loading includes the native kernels' build in the suite's fresh cache folder
STORY = [{"role": "user", "content": "Write a long story about a dragon."}]
PATH = "/v1/chat/completions"
MAX_TOKENS = 1500  # minutes of the default model's decoding: the replies are still running at the Ctrl-C


def read_to_end(sock: socket.socket) -> bytes:
    """What the server sent until it closed the connection (each read bounded by the socket's timeout)."""
    data = b""
    while piece := sock.recv(65536):
        data += piece
    return data


def requests_running(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=DEADLINE_S) as reply:
        return json.load(reply)["requests"]


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting: {what}"
        time.sleep(0.05)


def test_ctrl_c_while_requests_run_stops_quietly_and_answers_them(tmp_path):
    child = ChildOutput(subprocess.Popen([sys.executable, "-m", "hivekeeper.core.cli.main", "api", "--port", "0"],
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV, cwd=tmp_path))
    streamed = whole = None
    try:
        port = int(child.wait_for(r"serving \S+ at http://127\.0\.0\.1:(\d+)/v1", timeout=LOAD_DEADLINE_S).group(1))
        streamed = send_request(port, PATH, {"messages": STORY, "max_tokens": MAX_TOKENS, "stream": True}, None, DEADLINE_S)
        first = streamed.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first  # the stream began
        whole = send_request(port, PATH, {"messages": STORY, "max_tokens": MAX_TOKENS}, None, DEADLINE_S)
        wait_until(lambda: requests_running(port) == 2, "both requests being answered")
        child.proc.send_signal(signal.SIGINT)
        code = child.wait(DEADLINE_S)
        streamed_rest, whole_reply = read_to_end(streamed), read_to_end(whole)
    finally:
        child.close()
        for sock in (streamed, whole):
            if sock is not None:
                sock.close()
    assert code == 0, child.stderr
    assert "Traceback" not in child.stderr and "Exception in ASGI application" not in child.stderr, child.stderr
    assert "hivekeeper api: stopped" in child.stderr
    assert whole_reply.startswith(b"HTTP/1.1 503") and b"server_stopping" in whole_reply, whole_reply
    events = re.findall(rb"data: (.*)\r?\n", first + streamed_rest)
    assert b"server_stopping" in events[-2] and events[-1] == b"[DONE]", events[-3:]
