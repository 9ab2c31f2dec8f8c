"""`hivekeeper api`: serve one model over a local OpenAI-compatible HTTP API (core/api), so tools written for
OpenAI's API (editors, notebooks, the `openai` client) use a local or swarm model.

The model is opened as `hivekeeper chat` opens it (the planner's plan for a KV cache of the whole context, or a swarm
client with --swarm). Concurrent requests are decoded together, up to --max-batch at once, when the plan keeps every
block in memory (core/runtime/continuous.py); otherwise they are served one after another. It binds to 127.0.0.1 by
default; --port 0 takes a free port. Once the model is loaded and has
generated one token (so the first request pays no one-time costs), one line says where it listens
(`serving MODEL at http://HOST:PORT/v1`); Ctrl-C stops it. With --json-status (for the app) that line is instead
one JSON object per state change on stdout: {"state": "loading", "model": M}, {"state": "serving", "model": M,
"url": U, "runner": R}, then {"state": "stopped"}; errors still go to stderr as one line.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from hivekeeper.planner.errors import InputError

from hivekeeper.core.api import DEFAULT_HOST, DEFAULT_PORT
from hivekeeper.core.cli.generate import (add_model_arguments, check_budget, open_runner, resolve_model,
                                          set_threads)

# the plan counts a KV cache of the whole context, less this much reply
PLANNED_REPLY_TOKENS = 256
DEFAULT_MAX_BATCH = 8  # requests decoded together; more wait for a row to free
MAX_BATCH_LIMIT = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help=f"address to listen on (default {DEFAULT_HOST}: this machine only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"port to listen on (default {DEFAULT_PORT}; 0 = any free port, printed)")
    parser.add_argument("--api-key", metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on every request (default: none)")
    parser.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH, metavar="N",
                        help=f"requests decoded together at most (default {DEFAULT_MAX_BATCH}; 1 = one after another)")
    parser.add_argument("--verbose", action="store_true", help="log every request on stderr")
    parser.add_argument("--json-status", action="store_true",
                        help="one JSON line per state change on stdout (loading, serving, stopped), for the app")


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port must be 0..65535, got {args.port}")
    if not 1 <= args.max_batch <= MAX_BATCH_LIMIT:
        raise InputError(f"--max-batch must be 1..{MAX_BATCH_LIMIT}, got {args.max_batch}")
    ram_budget = check_budget(args)
    set_threads()
    if args.json_status:
        print_status({"state": "loading", "model": args.model})
    server = open_server(args, ram_budget)
    url = f"http://{args.host}:{server.port}/v1"
    if args.json_status:
        print_status({"state": "serving", "model": server.service.model_id, "url": url,
                      "runner": server.service.runner.description})
    else:
        print(f"serving {server.service.model_id} at {url} ({server.service.runner.description})", flush=True)
    signal.signal(signal.SIGTERM, interrupt)  # uvicorn re-raises the SIGTERM it caught once it has finished
    try:
        server.serve_forever()  # Ctrl-C (SIGINT) or SIGTERM: running requests cancelled, then returns
    except KeyboardInterrupt:
        pass
    finally:
        print("hivekeeper api: stopped", file=sys.stderr)
        server.server_close()
        server.service.close()
        if args.json_status:
            print_status({"state": "stopped"})
    return 0


def interrupt(signum, frame) -> None:
    """SIGTERM handled as Ctrl-C, so the server's closing steps (and the "stopped" line) run."""
    raise KeyboardInterrupt


def print_status(event: dict) -> None:
    """One state change as a JSON line on stdout (the shape gui/services/child_process.py reads)."""
    print(json.dumps(event), flush=True)


def open_server(args: argparse.Namespace, ram_budget: float | None):
    """The address bound first (one in use is an InputError naming it, before minutes of loading), then the model
    loaded and warmed up, and the server made."""
    from hivekeeper.core.api.server import APIServer, bind

    try:
        sock = bind(args.host, args.port)
    except OSError as exc:
        raise InputError(f"cannot listen on {args.host}:{args.port} ({exc.strerror or exc})") from None
    try:
        service = open_service(args, ram_budget)
    except BaseException:
        sock.close()
        raise
    try:
        return APIServer(service, sock, verbose=args.verbose)
    except BaseException:
        service.close()
        sock.close()
        raise


def open_service(args: argparse.Namespace, ram_budget: float | None):
    """The model as the API serves it: planned and loaded as `chat` does, its engine, one token generated."""
    from hivekeeper.core.api.service import ModelService, engine_for
    from hivekeeper.core.runtime.generation import context_limit

    path, tokenizer, config = resolve_model(args)
    context = context_limit(config)
    reply = min(PLANNED_REPLY_TOKENS, context - 1)
    runner = open_runner(args, path, tokenizer, config, batch=1, prompt_len=context - reply, max_length=context,
                         ram_budget=ram_budget)
    try:
        engine = engine_for(runner.model, tokenizer, args.max_batch)
    except BaseException:
        runner.close()
        raise
    service = ModelService(runner, tokenizer, config, engine, model_id=args.model, aliases=model_aliases(args.model),
                           swarm=args.swarm, api_key=args.api_key)
    try:
        service.warm_up()
    except BaseException:
        service.close()
        raise
    return service


def model_aliases(model: str) -> tuple[str, ...]:
    """Other names a client may give the model: a path's file or folder name."""
    name = Path(model).name
    return (name,) if name and name != model else ()
