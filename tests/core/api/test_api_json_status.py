"""`hivekeeper api --json-status`, the form the app starts: one JSON line per state change on stdout (loading,
serving with its URL, stopped after SIGTERM), the URL answering /v1/models with the model; and a port in use ending
the command with exit 2, one error line naming the address, and no "serving" line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest

from ...child_output import ChildOutput

pytestmark = pytest.mark.slow
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
DEADLINE_S = 120


def start_api(model, port: int) -> ChildOutput:
    command = [sys.executable, "-m", "hivekeeper.core.cli.main", "api", "--model", str(model), "--port", str(port),
               "--json-status"]
    return ChildOutput(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV))


def test_states_are_json_lines_and_the_url_serves_the_model(tiny_checkpoint):
    child = start_api(tiny_checkpoint, 0)
    try:
        loading = json.loads(child.readline(DEADLINE_S))
        assert loading == {"state": "loading", "model": str(tiny_checkpoint)}
        serving = json.loads(child.readline(DEADLINE_S))
        assert serving["state"] == "serving" and serving["model"] == str(tiny_checkpoint)
        assert serving["url"].startswith("http://127.0.0.1:") and serving["url"].endswith("/v1")
        with urllib.request.urlopen(serving["url"] + "/models", timeout=DEADLINE_S) as reply:
            models = json.load(reply)
        assert str(tiny_checkpoint) in [entry["id"] for entry in models["data"]]
        child.proc.send_signal(signal.SIGTERM)
        assert json.loads(child.readline(DEADLINE_S)) == {"state": "stopped"}
        assert child.wait(DEADLINE_S) == 0
        assert "serving " not in child.stdout  # the plain line is replaced, not repeated
    finally:
        child.close()


def test_a_port_in_use_is_one_error_line_and_exit_2(tiny_checkpoint):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        child = start_api(tiny_checkpoint, port)
        try:
            assert child.wait(DEADLINE_S) == 2
        finally:
            child.close()
    states = [json.loads(line)["state"] for line in child.stdout.splitlines()]
    assert states == ["loading"]
    errors = [line for line in child.stderr.splitlines() if line.startswith("hivekeeper api: error: ")]
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0], child.stderr
