"""The API's refusals and routes on a tiny random-weight checkpoint, served in this process on 127.0.0.1 (a real
HTTP server on a thread, real requests): the API key (401), unknown endpoints and models (404), a body over the
limit (413, before it is read), a prompt past the context (400 context_length_exceeded), fields we cannot honour."""

from __future__ import annotations

import http.client
import json
import threading

import pytest

from hivekeeper.core.api.schema import MAX_BODY_BYTES
from hivekeeper.core.cli.api import open_server
from hivekeeper.core.cli.main import build_parser

pytestmark = pytest.mark.usefixtures("one_torch_thread")
KEY = "sesame"
HTTP_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    args = build_parser().parse_args(["api", "--model", str(tiny_checkpoint), "--port", "0", "--api-key", KEY])
    api = open_server(args, None)
    thread = threading.Thread(target=api.serve_forever, daemon=True)
    thread.start()
    try:
        yield api
    finally:
        api.shutdown()
        api.server_close()
        api.service.close()
        thread.join(HTTP_TIMEOUT_S)


def call(server, method: str, path: str, body=None, key: str | None = KEY, headers: dict | None = None):
    """(status, JSON body) of one request."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=HTTP_TIMEOUT_S)
    all_headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}),
                   **(headers or {})}
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    try:
        connection.request(method, path, data, all_headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


HI = [{"role": "user", "content": "hi"}]


def test_the_api_key_is_required(server):
    assert call(server, "GET", "/v1/models", key=None)[0] == 401
    status, doc = call(server, "POST", "/v1/chat/completions", {"messages": HI}, key="wrong")
    assert status == 401 and doc["error"]["code"] == "invalid_api_key"
    status, doc = call(server, "POST", "/v1/chat/completions", {"messages": HI, "max_tokens": 2})
    assert status == 200 and doc["usage"]["completion_tokens"] <= 2


def test_the_model_is_named_by_its_path_or_folder_name(server, tiny_checkpoint):
    status, doc = call(server, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in doc["data"]] == [str(tiny_checkpoint)]
    assert call(server, "GET", f"/v1/models/{tiny_checkpoint.name}")[0] == 200
    status, doc = call(server, "POST", "/v1/completions", {"model": tiny_checkpoint.name, "prompt": "hi",
                                                          "max_tokens": 1})
    assert status == 200 and doc["model"] == str(tiny_checkpoint)
    status, doc = call(server, "GET", "/v1/models/other")
    assert status == 404 and doc["error"]["code"] == "model_not_found"
    status, doc = call(server, "POST", "/v1/chat/completions", {"model": "gpt-4", "messages": HI})
    assert status == 404 and doc["error"]["param"] == "model" and "'gpt-4'" in doc["error"]["message"]


def test_unknown_endpoints_are_404(server):
    assert call(server, "GET", "/v1/engines")[0] == 404
    assert call(server, "POST", "/v1/embeddings", {"input": "hi"})[0] == 404


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    status, doc = call(server, "POST", "/v1/chat/completions", b"{}",
                       headers={"Content-Length": str(MAX_BODY_BYTES + 1)})
    assert status == 413 and str(MAX_BODY_BYTES) in doc["error"]["message"]


def test_a_prompt_past_the_context_is_refused_naming_the_context(server):
    context = server.service.config.max_position_embeddings
    status, doc = call(server, "POST", "/v1/completions", {"prompt": "hi " * (2 * context), "max_tokens": 1})
    assert status == 400
    assert doc["error"]["code"] == "context_length_exceeded" and doc["error"]["param"] == "prompt"
    assert f"context is {context} tokens" in doc["error"]["message"]


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/chat/completions", {"messages": HI, "n": 2}, "n"),
    ("/v1/chat/completions", {"messages": HI, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/chat/completions", {"messages": HI, "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"messages": HI, "seed": -1}, "seed"),
    ("/v1/chat/completions", {"messages": HI, "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
])
def test_fields_that_cannot_be_honoured_are_400_naming_them(server, path, body, field):
    status, doc = call(server, "POST", path, body)
    assert status == 400 and doc["error"]["param"] == field, doc
