"""The OpenAI-compatible HTTP server: GET /v1/models, POST /v1/chat/completions and POST /v1/completions over one
opened model (service.ModelService), as an ASGI app (Starlette) served by uvicorn, the stack most Python LLM servers
use.

Requests are handled concurrently: each one is checked, then handed to the service's engine (a continuous batcher
decodes concurrent requests together, see core/runtime/continuous.py), and its text comes back through an asyncio
queue. A bad request gets an OpenAI-shaped JSON error (schema.APIError) naming the field, and the server goes on; so
does an error while generating (500; 503 through a swarm). With `stream: true` the text goes out as server-sent
events (`data: {chunk}` lines, then `data: [DONE]`). A client that disconnects cancels its request, which leaves the
batch (and frees its KV cache) at the next step: mid-stream, as the stream's generator is closed; without `stream`,
as the handler waiting for the whole reply looks every DISCONNECT_POLL_S whether its client is still there.

The requests being answered are counted (Requests, shown on /health). A server that stops (Ctrl-C, SIGTERM,
shutdown()) cancels them first: their handlers answer at once (503, the reply cut short) and uvicorn's graceful
shutdown has nothing left to wait for, rather than cancelling them after its timeout with a traceback each.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from hivekeeper.core.api.schema import (MAX_BODY_BYTES, APIError, GenerationRequest, chat_request,
                                        completion_request, parse_json)
from hivekeeper.core.api.service import ModelService, Reply
from hivekeeper.core.runtime.continuous import Completion

SHUTDOWN_TIMEOUT_S = 10
DISCONNECT_POLL_S = 0.1  # how often a handler waiting for a whole (non-streamed) reply looks for its client
CLIENT_GONE = 499  # what a handler whose client left answers (to nobody): nginx's "client closed request"


def build_app(service: ModelService, requests: Requests | None = None) -> Starlette:
    """The ASGI app of the API over `service`; `requests` counts (and at a stop cancels) the requests it answers."""
    requests = requests if requests is not None else Requests()

    async def models(request: HTTPRequest):
        return JSONResponse({"object": "list", "data": [service.model_card()]})

    async def model(request: HTTPRequest):
        service.check_model(request.path_params["name"])
        return JSONResponse(service.model_card())

    async def health(request: HTTPRequest):
        return JSONResponse({"status": "ok", "model": service.model_id, "requests": len(requests.pending)})

    async def chat(request: HTTPRequest):
        return await complete(request, service, requests, chat_request(parse_json(await body(request))))

    async def completions(request: HTTPRequest):
        return await complete(request, service, requests, completion_request(parse_json(await body(request))))

    routes = [Route("/v1/models", models), Route("/v1/models/{name:path}", model), Route("/health", health),
              Route("/", health), Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"])]
    middleware = [Middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["GET", "POST", "OPTIONS"],
                             allow_headers=["Authorization", "Content-Type"])]
    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers={APIError: api_error, 404: not_found, 405: not_allowed,
                                        Exception: failure_handler(service)})
    return KeyCheck(app, service)


class KeyCheck:
    """ASGI middleware: with an API key set, every HTTP request (but a browser's preflight) must carry it."""

    def __init__(self, app, service: ModelService):
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] != "OPTIONS":
            headers = dict(scope.get("headers") or [])
            try:
                self.service.check_key(headers.get(b"authorization", b"").decode("latin-1"))
            except APIError as exc:
                await error_response(exc)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def api_error(request, exc: APIError) -> JSONResponse:
    return error_response(exc)


async def not_found(request: HTTPRequest, exc) -> JSONResponse:
    return await api_error(request, APIError(404, f"no such endpoint: {request.method} {request.url.path}",
                                             code="not_found"))


async def not_allowed(request: HTTPRequest, exc) -> JSONResponse:
    return await api_error(request, APIError(405, f"{request.method} is not allowed on {request.url.path}",
                                             code="method_not_allowed"))


def failure_handler(service: ModelService):
    async def failed(request: HTTPRequest, exc: Exception) -> JSONResponse:
        return await api_error(request, service.failure(exc))
    return failed


async def body(request: HTTPRequest) -> bytes:
    """The request body, refused (413) past MAX_BODY_BYTES: by its Content-Length before reading, else as it comes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            length = int(declared)
        except ValueError:
            raise APIError(400, "the Content-Length header is not a number") from None
        if length > MAX_BODY_BYTES:
            raise too_large(length)
    data = bytearray()
    async for piece in request.stream():
        data += piece
        if len(data) > MAX_BODY_BYTES:
            raise too_large(len(data))
    return bytes(data)


def too_large(length: int) -> APIError:
    return APIError(413, f"the request body is {length} bytes; the limit is {MAX_BODY_BYTES} bytes",
                    code="request_too_large")


class Requests:
    """The requests being answered: handed to the engine, not yet done, their client still there. A stopping server
    cancels them (stop()) and takes no new ones."""

    def __init__(self):
        self.pending: set[Pending] = set()
        self.stopping = False

    def submit(self, engine, pending: Pending) -> None:
        if self.stopping:
            raise stopping_error()
        engine.submit(pending.engine_request)
        self.pending.add(pending)

    def stop(self) -> None:
        """Cancel every request (each leaves the engine at its next step; its handler answers a 503)."""
        self.stopping = True
        for pending in list(self.pending):
            pending.cancel()


def stopping_error() -> APIError:
    return APIError(503, "the server is stopping: ask again once it is back", error_type="service_unavailable",
                    code="server_stopping")


class Pending:
    """One request handed to the engine: its text and its end arrive on an asyncio queue from the engine's thread."""

    def __init__(self, service: ModelService, request: GenerationRequest, requests: Requests):
        self.loop = asyncio.get_running_loop()
        self.requests = requests
        self.events: asyncio.Queue = asyncio.Queue()
        self.engine_request = service.engine_request(request, self._text, self._done)

    def _put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self._arrived, item)
        except RuntimeError:  # the loop is gone (shutting down): nobody is waiting
            pass

    def _arrived(self, item) -> None:
        if item[0] == "done":
            self.requests.pending.discard(self)
        self.events.put_nowait(item)

    def _text(self, text: str) -> None:
        self._put(("text", text))

    def _done(self, outcome) -> None:
        self._put(("done", outcome))

    def cancel(self) -> None:
        """The engine drops the request at its next step (its client left, or the server stops); once done, a no-op."""
        self.engine_request.cancelled.set()
        self.requests.pending.discard(self)

    async def next_event(self):
        """("text", str) or ("done", Completion); an engine failure is raised, and so is a stop (a 503): a request
        cut short by the server's stop (its client still there) is not a whole reply."""
        kind, value = await self.events.get()
        if kind == "done" and isinstance(value, BaseException):
            raise value
        if kind == "done" and value.finish_reason == "stopped":
            raise stopping_error()
        return kind, value

    async def events_until_done(self):
        """("text", str) items, then ("done", Completion)."""
        while True:
            kind, value = await self.next_event()
            yield kind, value
            if kind == "done":
                return

    async def completion(self) -> Completion:
        while True:
            kind, value = await self.next_event()
            if kind == "done":
                return value

    async def completion_while_connected(self, http: HTTPRequest) -> Completion | None:
        """The whole reply's Completion; None when the client left first, looked at every DISCONNECT_POLL_S (the
        request is then cancelled: it frees its row, as a stream's does)."""
        waiting = asyncio.ensure_future(self.completion())
        try:
            while not (await asyncio.wait({waiting}, timeout=DISCONNECT_POLL_S))[0]:
                if await http.is_disconnected():
                    return None
            return waiting.result()
        finally:
            waiting.cancel()
            self.cancel()  # after the end, a no-op


async def complete(http: HTTPRequest, service: ModelService, requests: Requests, request: GenerationRequest):
    """Hand a checked request to the engine; the whole reply, or a stream of it."""
    reply = Reply(service, request)
    pending = Pending(service, request, requests)  # every refusal is raised here, before anything is sent
    requests.submit(service.engine, pending)
    if request.stream:
        return CancellingStream(stream(service, reply, pending), pending)
    done = await pending.completion_while_connected(http)
    return Response(status_code=CLIENT_GONE) if done is None else JSONResponse(reply.whole(done))


class CancellingStream(StreamingResponse):
    """The server-sent events of a reply, whose request is cancelled however the response ends: a client that left
    before the events began (the head not sent, or the disconnect seen first) ends it before `stream` ever started,
    and an async generator never started runs no `finally` when closed; that request went on to its max_tokens."""

    def __init__(self, events, pending: Pending):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.pending = pending

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.pending.cancel()  # after the end, a no-op


async def stream(service: ModelService, reply: Reply, pending: Pending):
    """The reply as server-sent events; the engine's failure after the 200 went out (or the server's stop) ends the
    stream with an error event. A client that leaves closes this generator, which cancels the request."""
    try:
        yield event(reply.chunk(first=True))
        try:
            async for kind, value in pending.events_until_done():
                if kind == "text":
                    yield event(reply.chunk(value))
                else:
                    yield event(reply.end_chunk(value))
                    if reply.request.include_usage:
                        yield event(reply.usage_chunk(value))
        except Exception as exc:  # noqa: BLE001 - the 200 is out: the error goes in the stream, which then ends
            yield event(service.failure(exc).body())
        yield event("[DONE]")
    finally:
        pending.cancel()


def event(payload) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


class APIServer:
    """The app served by uvicorn on a socket bound by the caller (bind(): so a port in use is an error before the
    model loads, and --port 0 gets a free port). serve_forever() blocks; shutdown() from another thread ends it."""

    def __init__(self, service: ModelService, sock: socket.socket, verbose: bool = False):
        self.service = service
        self.socket = sock
        self.requests = Requests()
        config = uvicorn.Config(build_app(service, self.requests), log_level="info" if verbose else "warning",
                                access_log=verbose, lifespan="off", timeout_graceful_shutdown=SHUTDOWN_TIMEOUT_S)
        self.server = StoppingServer(config, self.requests)
        self._stopped = threading.Event()

    @property
    def port(self) -> int:
        return self.socket.getsockname()[1]

    def serve_forever(self) -> None:
        try:
            self.server.run(sockets=[self.socket])
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        self.server.should_exit = True
        self._stopped.wait(SHUTDOWN_TIMEOUT_S + 5)

    def server_close(self) -> None:
        self.socket.close()


class StoppingServer(uvicorn.Server):
    """uvicorn's server, whose shutdown cancels the requests being answered before it waits for their handlers."""

    def __init__(self, config: uvicorn.Config, requests: Requests):
        super().__init__(config)
        self.requests = requests

    async def shutdown(self, sockets=None) -> None:
        self.requests.stop()
        await super().shutdown(sockets=sockets)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (IPv6 when the host is an IPv6 address); OSError if it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock

