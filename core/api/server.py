"""The OpenAI-compatible HTTP server: GET /v1/models, POST /v1/chat/completions and POST /v1/completions over one
opened model (a local offloaded model or a swarm client), on the same generation path as `hivekeeper chat`.

It is the standard library's HTTP server, one request at a time: the model decodes one sequence at a time anyway,
and the requests that come meanwhile wait in the listen queue. Each response closes its connection (HTTP/1.0), so
an idle keep-alive client never holds the server. A bad request gets an OpenAI-shaped JSON error (schema.APIError)
and the server goes on; so does an error while generating (500; 503 through a swarm). With `stream: true` the text
goes out as server-sent events (`data: {chunk}` lines, then `data: [DONE]`); a client that disconnects mid-stream
stops the generation at the next token, and its KV cache is freed.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer

from hivekeeper.planner.errors import InputError

from hivekeeper.core.api.schema import (MAX_BODY_BYTES, APIError, GenerationRequest, chat_request,
                                        completion_request, parse_json)

FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "length": "length", "stopped": "stop"}
OWNER = "hivekeeper"


@dataclass
class ModelService:
    """The model the API serves: the runner (core/cli/generate.Runner), its tokenizer and config, the id clients
    name it by (with other accepted names), and whether it runs through a swarm."""

    runner: object
    tokenizer: object
    config: object
    model_id: str
    aliases: tuple[str, ...] = ()
    swarm: bool = False
    api_key: str | None = None

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_id and name not in self.aliases:
            raise APIError(404, f"'model': this server serves {self.model_id!r}, not {name!r}", param="model",
                           code="model_not_found")

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """The request's prompt as token ids: messages through the model's chat template, or the raw prompt."""
        try:
            if request.is_chat:
                return list(self.tokenizer.apply_chat_template(request.messages, add_generation_prompt=True))
            return list(self.tokenizer.encode(request.prompt))
        except InputError as exc:
            param = "messages" if request.is_chat else "prompt"
            raise APIError(400, f"'{param}': {exc}", param=param) from None

    def max_new_tokens(self, request: GenerationRequest, prompt_tokens: int) -> int:
        """What the reply may hold: max_tokens, or the rest of the context; a prompt that leaves no room is a 400."""
        from hivekeeper.core.runtime.generation import context_limit

        context = context_limit(self.config)
        room = context - prompt_tokens
        param = "messages" if request.is_chat else "prompt"
        if room < 1:
            raise APIError(400, f"'{param}': the prompt has {prompt_tokens} tokens; the model's context is "
                                f"{context} tokens, which leaves no room for a reply: shorten it",
                           param=param, code="context_length_exceeded")
        if request.max_tokens is not None and request.max_tokens > room:
            raise APIError(400, f"'max_tokens': {request.max_tokens} new tokens after a prompt of {prompt_tokens} "
                                f"tokens exceed the model's context of {context} tokens (at most {room})",
                           param="max_tokens", code="context_length_exceeded")
        return request.max_tokens or room

    def warm_up(self) -> None:
        """One token generated before the server answers: what runs once per process (the native kernels' build
        on first use, the first allocations) is not paid by the first client."""
        from hivekeeper.core.runtime.generation import generate

        generate(self.runner.model, self.tokenizer.encode("Hello") or [0], max_new_tokens=1)

    def generate(self, request: GenerationRequest, on_text, stop: threading.Event):
        """(prompt token count, GenerationResult) for a checked request; on_text(text) gets the reply as it comes."""
        from hivekeeper.core.runtime.generation import generate
        from hivekeeper.core.runtime.sampling import SamplingParams

        self.check_model(request.model)
        ids = self.prompt_ids(request)
        max_new = self.max_new_tokens(request, len(ids))
        sampling = SamplingParams(temperature=request.temperature, top_p=request.top_p, seed=request.seed)
        stops = tuple(getattr(self.tokenizer, "stop_strings", ())) + tuple(request.stop)
        return generate(self.runner.model, ids, max_new_tokens=max_new, sampling=sampling,
                        tokenizer=self.tokenizer, stop_strings=stops,
                        on_text=lambda row, piece: on_text(piece), stop=stop)


def usage(result) -> dict:
    completion = len(result.token_ids[0])
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": completion,
            "total_tokens": result.prompt_tokens + completion}


class Reply:
    """The OpenAI objects of one response: ids, the chat or completion shapes, whole or as stream chunks."""

    def __init__(self, service: ModelService, request: GenerationRequest):
        self.service, self.request = service, request
        self.id = ("chatcmpl-" if request.is_chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if request.is_chat else "text_completion"

    def envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.service.model_id,
                "system_fingerprint": OWNER, "choices": choices}

    def whole(self, result) -> dict:
        reason = FINISH_REASONS.get(result.finish_reasons[0], "stop")
        text = result.texts[0]
        if self.request.is_chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                      "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
        return {**self.envelope(self.object, [choice]), "usage": usage(result)}

    def chunk(self, text: str | None = None, reason: str | None = None, first: bool = False) -> dict:
        """One stream chunk: the reply's next text (the chat's first one also carries the role), or the end."""
        if self.request.is_chat:
            delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            return self.envelope("chat.completion.chunk", [choice])
        return self.envelope("text_completion", [{"index": 0, "text": text or "", "finish_reason": reason,
                                                  "logprobs": None}])

    def usage_chunk(self, result) -> dict:
        chunk_object = "chat.completion.chunk" if self.request.is_chat else "text_completion"
        return {**self.envelope(chunk_object, []), "usage": usage(result)}


class ClientGone(Exception):
    """The client closed its connection while a reply streamed."""


class APIHandler(BaseHTTPRequestHandler):
    """One HTTP request: routed to an endpoint; every refusal and failure answered as OpenAI-shaped JSON."""

    server_version = "hivekeeper-api"
    protocol_version = "HTTP/1.0"  # one response per connection: a keep-alive client never holds the server

    @property
    def service(self) -> ModelService:
        return self.server.service

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's signature
        if getattr(self.server, "verbose", False):
            super().log_message(format, *args)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self.answer(self.route_get)

    def do_POST(self) -> None:  # noqa: N802
        self.answer(self.route_post)

    def do_OPTIONS(self) -> None:  # noqa: N802 - a browser's preflight
        self.send_response(204)
        self.cors_headers()
        self.end_headers()

    def cors_headers(self) -> None:
        self.send_header("Access-Control-Allow-Origin", "*")
        self.send_header("Access-Control-Allow-Headers", "Authorization, Content-Type")
        self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")

    def answer(self, route) -> None:
        try:
            self.check_key()
            route(self.path.split("?", 1)[0].rstrip("/"))
        except APIError as exc:
            self.send_json(exc.status, exc.body())
        except ClientGone:
            pass
        except Exception as exc:  # noqa: BLE001 - the server answers and goes on whatever failed
            error = self.failure(exc)
            self.send_json(error.status, error.body())

    def failure(self, exc: Exception) -> APIError:
        """What a failed generation answers: 400 for bad input, else 500 (503 through a swarm: its servers)."""
        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, InputError):
            return APIError(400, str(exc))
        status, kind = (503, "service_unavailable") if self.service.swarm else (500, "server_error")
        return APIError(status, f"{type(exc).__name__}: {exc}", error_type=kind)

    def check_key(self) -> None:
        key = self.service.api_key
        if key and self.headers.get("Authorization", "") != f"Bearer {key}":
            raise APIError(401, "a valid API key is required: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key", error_type="authentication_error")

    def route_get(self, path: str) -> None:
        if path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [self.model_card()]})
        elif path.startswith("/v1/models/"):
            self.service.check_model(path[len("/v1/models/"):])
            self.send_json(200, self.model_card())
        elif path in ("", "/health"):
            self.send_json(200, {"status": "ok", "model": self.service.model_id})
        else:
            raise APIError(404, f"no such endpoint: GET {path}", code="not_found")

    def model_card(self) -> dict:
        return {"id": self.service.model_id, "object": "model", "created": int(time.time()), "owned_by": OWNER}

    def route_post(self, path: str) -> None:
        if path == "/v1/chat/completions":
            self.complete(chat_request(parse_json(self.body())))
        elif path == "/v1/completions":
            self.complete(completion_request(parse_json(self.body())))
        else:
            raise APIError(404, f"no such endpoint: POST {path}", code="not_found")

    def body(self) -> bytes:
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            raise APIError(400, "the Content-Length header is not a number") from None
        if length > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is {length} bytes; the limit is {MAX_BODY_BYTES} bytes",
                           code="request_too_large")
        return self.rfile.read(length) if length > 0 else b""

    def complete(self, request: GenerationRequest) -> None:
        reply = Reply(self.service, request)
        if request.stream:
            self.stream(reply)
            return
        result = self.service.generate(request, lambda text: None, threading.Event())
        self.send_json(200, reply.whole(result))

    def stream(self, reply: Reply) -> None:
        """The reply as server-sent events. The request is fully checked before the 200 goes out (errors stay JSON
        errors); a disconnect stops the generation."""
        service, request = self.service, reply.request
        service.check_model(request.model)
        service.max_new_tokens(request, len(service.prompt_ids(request)))
        stop = threading.Event()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.cors_headers()
        self.end_headers()
        self.event(reply.chunk(first=True), stop)
        try:
            result = service.generate(request, lambda text: self.event(reply.chunk(text), stop), stop)
        except Exception as exc:  # noqa: BLE001 - the 200 is out: the error goes in the stream, which then ends
            self.event(self.failure(exc).body(), stop)
            self.event("[DONE]", stop)
            return
        if stop.is_set():
            raise ClientGone()
        self.event(reply.chunk(reason=FINISH_REASONS.get(result.finish_reasons[0], "stop")), stop)
        if request.include_usage:
            self.event(reply.usage_chunk(result), stop)
        self.event("[DONE]", stop)

    def event(self, payload, stop: threading.Event) -> None:
        """One `data:` line; a failed write (the client left) sets `stop` and drops the rest."""
        if stop.is_set():
            return
        data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
        try:
            self.wfile.write(f"data: {data}\n\n".encode("utf-8"))
            self.wfile.flush()
        except OSError:
            stop.set()

    def send_json(self, status: int, doc: dict) -> None:
        data = json.dumps(doc, ensure_ascii=False).encode("utf-8")
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.cors_headers()
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass  # the client left


class APIServer(HTTPServer):
    """The HTTP server with the model service its handlers answer from."""

    def __init__(self, service: ModelService, host: str, port: int, verbose: bool = False):
        self.service, self.verbose = service, verbose
        super().__init__((host, port), APIHandler)

    @property
    def port(self) -> int:
        return self.server_address[1]
