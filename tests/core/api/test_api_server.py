"""`hivekeeper api` as a real subprocess on 127.0.0.1 (a free port it prints), driven over real HTTP with urllib,
on the real default model (loaded once for the module): answers, streaming equal to non-streaming with a seed,
token counts, OpenAI-shaped 400/404 errors naming the field, and the server still answering after each."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from hivekeeper.core.runtime.default_model import DEFAULT_MODEL_ID, default_model_file

from ...child_output import ChildOutput

pytestmark = pytest.mark.skipif(default_model_file() is None,
                                reason="the default model is not installed (make run installs it)")

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
QUESTION = "What is the capital of France? Answer in one sentence."
HTTP_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def api():
    """The base URL of a running `hivekeeper api --port 0` on the default model."""
    proc = subprocess.Popen([sys.executable, "-m", "hivekeeper.core.cli.main", "api", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    child = ChildOutput(proc)
    try:
        # loading includes the native kernels' build in the suite's fresh cache folder: slow on a busy machine
        match = child.wait_for(r"serving \S+ at (http://127\.0\.0\.1:\d+/v1)", timeout=240)
        yield match.group(1)
    finally:
        child.close()


def post(url: str, body: bytes | dict) -> tuple[int, bytes]:
    """(status, body) of a POST; an HTTP error status is returned, not raised."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def chat(api: str, **fields) -> dict:
    status, body = post(f"{api}/chat/completions", {"messages": [{"role": "user", "content": QUESTION}], **fields})
    assert status == 200, body
    return json.loads(body)


def stream_events(raw: bytes) -> list:
    """The `data:` payloads of a server-sent event stream, JSON decoded ([DONE] kept as the string)."""
    lines = [line[len("data: "):] for line in raw.decode().split("\n\n") if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def test_models_lists_the_served_model(api):
    with urllib.request.urlopen(f"{api}/models", timeout=HTTP_TIMEOUT_S) as response:
        doc = json.loads(response.read())
    assert [m["id"] for m in doc["data"]] == [DEFAULT_MODEL_ID]


def test_chat_completion_answers_paris_with_usage_counts(api):
    doc = chat(api, temperature=0, max_tokens=16)
    choice = doc["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert "Paris" in choice["message"]["content"]
    usage = doc["usage"]
    assert usage["prompt_tokens"] > len(QUESTION.split())  # the question inside the chat template
    assert 1 <= usage["completion_tokens"] <= 16
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_max_tokens_caps_the_reply_with_finish_reason_length(api):
    doc = chat(api, temperature=0, max_tokens=2)
    assert doc["usage"]["completion_tokens"] == 2
    assert doc["choices"][0]["finish_reason"] == "length"


def test_streaming_gives_the_same_text_as_not_streaming_with_a_seed(api):
    fields = {"temperature": 0.9, "top_p": 0.95, "seed": 7, "max_tokens": 8}
    whole = chat(api, **fields)
    status, raw = post(f"{api}/chat/completions", {"messages": [{"role": "user", "content": QUESTION}],
                                                   "stream": True, "stream_options": {"include_usage": True},
                                                   **fields})
    assert status == 200
    events = stream_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert events[-2]["usage"] == whole["usage"]


def test_completions_continue_a_raw_prompt(api):
    status, body = post(f"{api}/completions", {"prompt": "The capital of France is", "max_tokens": 4,
                                               "temperature": 0})
    assert status == 200, body
    doc = json.loads(body)
    assert doc["object"] == "text_completion"
    assert "Paris" in doc["choices"][0]["text"]
    assert doc["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("body, status, field", [
    (b'{"messages": [', 400, None),
    (b"[" * 100_000 + b"]" * 100_000, 400, None),  # nested past the parser's recursion limit: was a 500 and a traceback
    ({"model": DEFAULT_MODEL_ID}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10 ** 6}, 400, "max_tokens"),
])
def test_a_bad_request_gets_an_openai_error_naming_the_field_and_the_server_goes_on(api, body, status, field):
    got, raw = post(f"{api}/chat/completions", body)
    assert got == status, raw
    error = json.loads(raw)["error"]
    assert error["message"] and error["type"]
    if field is None:
        assert error["code"] == "invalid_json"
    else:
        assert error["param"] == field and f"'{field}'" in error["message"]
    assert chat(api, temperature=0, max_tokens=1)["usage"]["completion_tokens"] == 1


def test_a_stop_string_cuts_the_reply_before_it(api):
    whole = chat(api, temperature=0, max_tokens=12)["choices"][0]["message"]["content"]
    cut = chat(api, temperature=0, max_tokens=12, stop=["Paris"])["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert cut["message"]["content"] == whole[:whole.index("Paris")]


def test_a_client_leaving_mid_stream_does_not_stop_the_server(api):
    host, port = api.split("//")[1].split("/")[0].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=HTTP_TIMEOUT_S)
    body = {"messages": [{"role": "user", "content": "Count from 1 to 500."}], "stream": True, "max_tokens": 400,
            "temperature": 0}
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")  # the stream began
    response.close()  # the response holds the socket too: both let go of it, the connection is closed
    connection.close()
    assert chat(api, temperature=0, max_tokens=1)["usage"]["completion_tokens"] == 1
