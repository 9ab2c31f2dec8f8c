"""Child process for the app's coverage chart: join a swarm as a client and print its status every few seconds.

    python -m hivekeeper.gui.services.swarm_watch --model PATH|ID --initial-peers MADDR... [--period 3]

    python -m hivekeeper.gui.services.swarm_watch --directory --initial-peers MADDR... [--period 10]

One JSON line per report (the same object as `hivekeeper swarm status --json`, plus "time"); with --directory, one
{"event": "directory", "models": [...], "best": prefix} line per period instead: the models in the swarm's registry
with their coverage and where this machine would help (core/swarm/directory.py). An error is one line
{"event": "error", "message": ...}; bootstrap peers nobody answers from are "bootstrap peers unreachable: ...". It exits when its stdin closes (the app quit or died) or on SIGTERM, so it
never outlives the app, and shuts its p2pd down on the way out. hivemind stays out of the GUI process this way.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="swarm_watch")
    parser.add_argument("--model")
    parser.add_argument("--directory", action="store_true", help="list the swarm's models instead of one's coverage")
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--dht-prefix")
    parser.add_argument("--period", type=float, default=3.0)
    return parser.parse_args(argv)


def _print(doc: dict) -> None:
    print(json.dumps(doc), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    def watch_stdin() -> None:  # EOF: the app is gone
        while sys.stdin.readline():
            pass
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    from hivekeeper.core.swarm.bootstrap import any_reachable, unreachable_message

    if not any_reachable(args.initial_peers):  # say so in a second or two, before hivemind and torch load
        _print({"event": "error", "message": unreachable_message(args.initial_peers)})
        return 2
    if args.directory:
        return watch_directory(args, stop)
    if not args.model:
        _print({"event": "error", "message": "--model is required (or --directory)"})
        return 2

    from hivekeeper.core.runtime.checkpoint import load_config, resolve_checkpoint
    from hivekeeper.core.swarm.client.inference import ClientConfig, SwarmClient
    from hivekeeper.core.swarm.dht import dht_prefix_for
    from hivekeeper.core.swarm.status import read_swarm_status
    from hivekeeper.planner.errors import InputError

    try:
        config = load_config(resolve_checkpoint(args.model, blocks=(0, 0), embeddings=False))
        prefix = dht_prefix_for(args.model, args.dht_prefix)
        client = SwarmClient(ClientConfig(tuple(args.initial_peers), prefix, config.num_layers))
    except (InputError, OSError) as exc:
        _print({"event": "error", "message": _in_words(str(exc), args.initial_peers)})
        return 2
    try:
        while not stop.is_set():
            try:
                report = client.run(read_swarm_status(client, prefix), timeout=60)
                _print({"event": "report", "time": time.time(), **report})
            except Exception as exc:  # one failed read is reported; the next period tries again
                _print({"event": "error", "message": f"{type(exc).__name__}: {exc}"})
            stop.wait(args.period)
    finally:
        client.close()
    return 0


def _in_words(message: str, peers) -> str:
    from hivekeeper.core.swarm.bootstrap import is_unreachable_error, unreachable_message

    return unreachable_message(peers) if is_unreachable_error(message) else message


def watch_directory(args: argparse.Namespace, stop: threading.Event) -> int:
    """Print the swarm's models, their coverage and where this machine would help, every period."""
    from hivekeeper.core.swarm.client.inference import ClientConfig, SwarmClient
    from hivekeeper.core.swarm.directory import (HelpPlanner, directory_report, live_peers_of, peers_here,
                                                 read_directory)
    from hivekeeper.planner.errors import InputError

    try:
        client = SwarmClient(ClientConfig(tuple(args.initial_peers), "_directory", 1))
    except (InputError, OSError) as exc:
        _print({"event": "error", "message": _in_words(str(exc), args.initial_peers)})
        return 2
    planner = HelpPlanner()
    try:
        while not stop.is_set():
            try:
                rows = client.run(read_directory(client.dht), timeout=60)
                here = client.run(peers_here(client, live_peers_of(rows)), timeout=60)  # this machine's servers
                _print({"event": "directory", "time": time.time(), **directory_report(rows, planner, here)})
            except Exception as exc:  # one failed read is reported; the next period tries again
                _print({"event": "error", "message": f"{type(exc).__name__}: {exc}"})
            stop.wait(args.period)
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
