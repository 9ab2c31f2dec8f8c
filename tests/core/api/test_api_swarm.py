"""`hivekeeper api --swarm`: the API over a model whose blocks run in a loopback swarm (one real `hivekeeper serve`
of a tiny checkpoint on 127.0.0.1) answers with the same greedy text as the API over the local model, streaming and
not."""

from __future__ import annotations

import threading

import pytest

from hivekeeper.core.cli.api import open_server
from hivekeeper.core.cli.main import build_parser
from hivekeeper.core.swarm.local import LocalSwarm

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
HTTP_TIMEOUT_S = 120
BODY = {"prompt": "hello there", "max_tokens": 6, "temperature": 0}


def serving(args: list[str]):
    """An API server in this process on a free port, answering on a thread."""
    api = open_server(build_parser().parse_args(["api", "--port", "0", *args]), None)
    threading.Thread(target=api.serve_forever, daemon=True).start()
    return api


def stop(api) -> None:
    api.shutdown()
    api.server_close()
    api.service.close()


def completion(openai, api, body: dict) -> tuple[int, str]:
    """(200, text) of a completion through the official `openai` client, streamed or not."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{api.port}/v1", api_key="unused", timeout=HTTP_TIMEOUT_S,
                           max_retries=0)
    model = client.models.list().data[0].id
    reply = client.completions.create(model=model, **body)
    if not body.get("stream"):
        return 200, reply.choices[0].text
    return 200, "".join(chunk.choices[0].text for chunk in reply if chunk.choices)


def test_the_api_through_a_swarm_answers_like_the_local_model(tiny_checkpoint, tmp_path, openai):
    local = serving(["--model", str(tiny_checkpoint)])
    try:
        expected = completion(openai, local, BODY)
    finally:
        stop(local)
    assert expected[0] == 200 and expected[1]
    with LocalSwarm(tiny_checkpoint, extra_args=("--torch-threads", "1"), log_dir=tmp_path) as swarm:
        swarm.start(timeout=120)
        remote = serving(["--model", str(tiny_checkpoint), "--swarm", "--initial-peers", *swarm.initial_peers])
        try:
            assert completion(openai, remote, BODY) == expected
            assert completion(openai, remote, {**BODY, "stream": True}) == expected
        finally:
            stop(remote)
