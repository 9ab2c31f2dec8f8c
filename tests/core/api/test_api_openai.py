"""`hivekeeper api` driven by the official `openai` client, as its users drive it, on a tiny checkpoint served in
this process (a real uvicorn server on 127.0.0.1): greedy text equal to `hivekeeper generate`, streaming equal to
not streaming, concurrent streams decoded in one batch with each one's own text, a client that leaves (mid-stream, or
waiting for a whole reply) freeing its row, and the client's own error types for a bad key, a bad field and a prompt
past the context."""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

from hivekeeper.core.cli.api import open_server
from hivekeeper.core.cli.main import build_parser, main

from .raw_http import send_request

pytestmark = pytest.mark.usefixtures("one_torch_thread")
KEY = "sesame"
PROMPTS = ["hello there", "the cat sat on the mat and", "one two", "a b c d e f g h i j"]
NEW_TOKENS = 10
LONG_TOKENS = 2000  # a reply "count" goes on with to its max_tokens (the tiny model's context is 2048 tokens)
DEADLINE_S = 120


@pytest.fixture(scope="module", autouse=True)
def torch_decode_only():
    """Alone and in a batch, every step runs torch's code (the native and numpy decode paths off): the batch's
    equality with each sequence alone is then a matter of float rounding between two torch matmul shapes, not of two
    different kernels, whose greedy choices can part at a near-tie of a random-weight model (a CI run saw it)."""
    from hivekeeper.core.runtime.kernels import cpu_decode, native_kernels

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native_kernels, "ENABLED", False)
        patch.setattr(cpu_decode, "ENABLED", False)
        yield


@pytest.fixture(scope="module")
def api(tiny_checkpoint):
    server = open_server(build_parser().parse_args(
        ["api", "--model", str(tiny_checkpoint), "--port", "0", "--api-key", KEY]), None)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        server.service.close()
        thread.join(DEADLINE_S)


@pytest.fixture(scope="module")
def client(api, openai):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{api.port}/v1", api_key=KEY, timeout=DEADLINE_S, max_retries=0)


@pytest.fixture(scope="module")
def generated(tiny_checkpoint):
    """`hivekeeper generate --json`'s greedy text of each prompt (the command, run in this process)."""
    import contextlib
    import io

    texts = []
    for prompt in PROMPTS:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["generate", "--model", str(tiny_checkpoint), "--prompt", prompt, "--json",
                         "--max-new-tokens", str(NEW_TOKENS), "--temperature", "0"])
        assert code == 0
        texts.append(json.loads(out.getvalue())["text"])
    return texts


def complete(client, prompt: str, **fields):
    return client.completions.create(model=client_model(client), prompt=prompt, max_tokens=NEW_TOKENS,
                                     temperature=0, **fields)


def client_model(client) -> str:
    return client.models.list().data[0].id


def streamed_text(stream) -> str:
    return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)


def test_greedy_completions_equal_hivekeeper_generate_streamed_or_not(client, generated):
    for prompt, expected in zip(PROMPTS, generated):
        whole = complete(client, prompt)
        assert whole.choices[0].text == expected
        assert streamed_text(complete(client, prompt, stream=True)) == expected


def test_chat_streams_the_same_reply_with_usage(client):
    messages = [{"role": "user", "content": "hello"}]
    model = client_model(client)
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=6, seed=3, temperature=0.8)
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=6, seed=3, temperature=0.8,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting: {what}"
        time.sleep(0.02)


def test_concurrent_streams_are_decoded_together_each_with_its_own_text(api, client, generated):
    engine = api.service.engine
    texts, errors = {}, []

    def ask(i: int) -> None:
        try:
            texts[i] = streamed_text(complete(client, PROMPTS[i], stream=True))
        except Exception as exc:  # noqa: BLE001 - reported by the assert below
            errors.append(exc)

    model = client_model(client)  # (before holding: it needs no engine)
    assert model
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    with engine.hold():
        for thread in threads:
            thread.start()
        wait_until(lambda: engine.waiting == len(PROMPTS), "every request queued")
    for thread in threads:
        thread.join(DEADLINE_S)
    assert not errors
    assert [texts[i] for i in range(len(PROMPTS))] == generated
    assert engine.stats.largest_batch == len(PROMPTS)


def test_a_client_that_leaves_mid_stream_frees_its_row(api, client):
    engine = api.service.engine
    stream = client.completions.create(model=client_model(client), prompt="count", max_tokens=100, temperature=0,
                                       stream=True)
    next(iter(stream))  # the stream began
    stream.close()
    wait_until(lambda: engine.active == 0 and engine.waiting == 0, "the left request's row freed")
    assert complete(client, PROMPTS[0]).usage.completion_tokens == NEW_TOKENS


def test_errors_arrive_as_the_clients_own_error_types(api, client, openai):
    wrong = openai.OpenAI(base_url=f"http://127.0.0.1:{api.port}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    model = client_model(client)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], top_p=0)
    context = api.service.config.max_position_embeddings
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="hi " * (2 * context), max_tokens=1)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=1)


def health(api) -> dict:
    connection = http.client.HTTPConnection("127.0.0.1", api.port, timeout=DEADLINE_S)
    try:
        connection.request("GET", "/health", headers={"Authorization": f"Bearer {KEY}"})
        return json.loads(connection.getresponse().read())
    finally:
        connection.close()


def test_a_client_that_leaves_before_its_whole_reply_frees_its_row(api, client):
    """Without `stream`: the client hangs up while the engine is held mid-reply (so the request cannot end on its
    own); the server lets the request go, and once released the engine drops it without another step, though it had
    nearly all of its max_tokens to go."""
    engine = api.service.engine
    before = engine.stats.steps
    sock = send_request(api.port, "/v1/completions", {"model": client_model(client), "prompt": "count",
                                                      "max_tokens": LONG_TOKENS, "temperature": 0}, KEY, DEADLINE_S)
    try:
        wait_until(lambda: engine.stats.steps > before, "the reply under way")
        with engine.hold():  # no step runs meanwhile
            held = engine.stats.steps
            assert engine.active == 1 and held - before < LONG_TOKENS - 1  # still generating
            assert health(api)["requests"] == 1
            sock.close()
            wait_until(lambda: health(api)["requests"] == 0, "the server letting the left request go")
    finally:
        sock.close()
    wait_until(lambda: engine.active == 0 and engine.waiting == 0, "the left request's row freed")
    assert engine.stats.steps == held  # dropped at its next step, without decoding it
    assert complete(client, PROMPTS[0]).usage.completion_tokens == NEW_TOKENS


def test_a_stream_whose_client_left_before_it_began_is_cancelled(api, client):
    """The client is gone before the stream's first event: the response head waits on the connection and the next
    message the server receives is the disconnect (uvicorn's ASGI 2.3: Starlette then cancels the response's
    sending), so the events' generator never starts, and a generator that never started runs none of its code when closed: the request used to
    generate on to its max_tokens. Driven through the served ASGI app with the engine held, so the request cannot
    end on its own meanwhile."""
    import asyncio

    engine, app = api.service.engine, api.server.config.app
    body = json.dumps({"model": client_model(client), "prompt": "count", "max_tokens": LONG_TOKENS,
                       "temperature": 0, "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 9), "server": ("127.0.0.1", api.port),
             "headers": [(b"authorization", f"Bearer {KEY}".encode()), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    arriving = [{"type": "http.request", "body": body, "more_body": False}]
    sent = []

    async def receive():
        return arriving.pop(0) if arriving else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message["type"])
        if message["type"] == "http.response.start":
            await asyncio.Event().wait()  # the head waits on a connection nobody reads (until the disconnect)

    with engine.hold():  # no step runs meanwhile
        held = engine.stats.steps
        asyncio.run(asyncio.wait_for(app(scope, receive, send), DEADLINE_S))
        assert sent == ["http.response.start"]  # nothing of the stream went out
        assert health(api)["requests"] == 0  # the server let the request go
    wait_until(lambda: engine.active == 0 and engine.waiting == 0, "the left request's row freed")
    assert engine.stats.steps == held  # dropped before its first step
