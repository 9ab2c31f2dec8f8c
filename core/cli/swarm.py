"""`hivekeeper swarm status`: who serves which blocks of a model, how fast, and where the bottleneck is;
`hivekeeper swarm models`: the models the swarm serves, their coverage, and where this machine would help most
(core/swarm/directory.py, what the app's Swarm page lists).

A server listed OFFLINE is asked (rpc_info) whether it serves its blocks, as the client does before routing: anyone
can write an OFFLINE record under a server's key. Every server the DHT lists as live is pinged first (rpc_info, a 2 s
timeout): one that does not answer is shown as "unreachable" and covers no block, so a server killed a moment ago
shows as gone now, not when its record expires minutes later. The report is core/swarm/status.py's, which the app's coverage chart shows too
(gui/services/swarm_watch.py).
"""

from __future__ import annotations

import argparse
import json

from hivekeeper.planner.errors import InputError
from hivekeeper.planner.words import counted


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="swarm_command", metavar="SUBCOMMAND")
    status = sub.add_parser("status", help="per block: the servers covering it; per server: state, span, speed")
    status.add_argument("--model", required=True, help="hub id or local checkpoint folder (for its block count)")
    status.add_argument("--initial-peers", nargs="+", metavar="MADDR", help="peers of the swarm (default: the "
                        "public Petals swarm's bootstrap peers, or HIVEKEEPER_BOOTSTRAP_PEERS when set)")
    status.add_argument("--dht-prefix", help="the model's name in the swarm (default as `hivekeeper serve`)")
    status.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    models = sub.add_parser("models", help="the models the swarm serves, their coverage, where this machine helps")
    models.add_argument("--initial-peers", nargs="+", metavar="MADDR", help="peers of the swarm (default as status)")
    models.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def print_tables(report: dict) -> None:
    online = sum(s["state"] == "online" for s in report["servers"])
    unreachable = sum(s["state"] == "unreachable" for s in report["servers"])
    print(f"swarm of {report['dht_prefix']}: {counted(report['num_blocks'], 'block')}, "
          f"{counted(len(report['servers']), 'server')} "
          f"({online} online{f', {unreachable} unreachable' if unreachable else ''})")
    print(f"{'block':>5}  {'throughput':>10}  servers")
    for block in report["blocks"]:
        names = ", ".join(p[-8:] for p in block["servers"]) or "NONE (gap)"
        if block.get("unreachable"):
            names += f"  (listed but unreachable: {', '.join(p[-8:] for p in block['unreachable'])})"
        print(f"{block['index']:>5}  {block['throughput']:>10.1f}  {names}")
    if report["bottleneck"]:
        print(f"bottleneck: block {report['bottleneck']['block']} ({report['bottleneck']['throughput']:.1f} rps)")
    if report["gaps"]:
        print(f"gaps: blocks {', '.join(map(str, report['gaps']))} have no server")
    print()
    print(f"{'peer':<10} {'state':<11} {'blocks':<9} {'rps':>9} {'infer/s':>9} {'cache left':>10} {'rtt ms':>7}  name")
    for s in report["servers"]:
        rtt = "-" if s["rtt"] is None else f"{s['rtt'] * 1e3:.1f}"
        span = f"{s['start']}:{s['end']}"
        print(f"{s['peer_id'][-8:]:<10} {s['state']:<11} {span:<9} "
              f"{_fmt(s['throughput']):>9} {_fmt(s['inference_rps']):>9} {_fmt(s['cache_tokens_left']):>10} "
              f"{rtt:>7}  {s['public_name'] or ''}")


def other_models_line(report: dict) -> str:
    """The line for a prefix nobody serves in a swarm that lists other models: their prefixes, and --dht-prefix."""
    names = ", ".join(f"{m['dht_prefix']} ({m['repository']}, {counted(m['num_blocks'], 'block')})"
                      for m in report["other_models"])
    return (f"no server found under {report['dht_prefix']}; the swarm's registry lists {names}: "
            f"pass --dht-prefix PREFIX to see one (a model's prefix follows the name `serve --model` was given)")


def _peers(given) -> tuple[str, ...]:
    """The peers given, else the default swarm's; peers nobody answers from are one line (core/swarm/bootstrap.py)."""
    from hivekeeper.core.swarm.bootstrap import any_reachable, bootstrap_peers, unreachable_message

    peers = tuple(given or bootstrap_peers())
    if not any_reachable(peers):
        raise InputError(unreachable_message(peers))
    return peers


def print_models(report: dict) -> None:
    rows = report["models"]
    best = f"; this machine helps most with {report['best']}" if report["best"] else ""
    print(f"{counted(len(rows), 'model')} in the swarm's registry{best}")
    print(f"{'model':<32} {'servers':>7} {'covered':>9}  {'weakest blocks':<20} you could serve")
    for row in rows:
        weak, helps = row["weakest"], row["help"]
        weakest = f"{weak['start']}:{weak['end']} ({weak['throughput']:.3g} rps)" if weak else "-"
        could = (f"blocks {helps['blocks'][0]}:{helps['blocks'][1]}, ~{helps['rps']:.3g} rps{rps_source(helps)}"
                 if helps.get("blocks") else helps.get("reason") or "no block fits here")
        print(f"{row['dht_prefix'][:32]:<32} {row['servers']:>7} {row['covered_blocks']:>4} of {row['num_blocks']:<3} "
              f"{weakest:<20} {could}")


def rps_source(helps: dict) -> str:
    """Where the requests/s offered come from: serve's measurement here (the planner's figure beside it), or ""."""
    if helps.get("planner_rps") is None:
        return ""
    return f" ({helps['source']}; planner ~{helps['planner_rps']:.3g})"


def run_models(args: argparse.Namespace) -> int:
    from hivekeeper.core.swarm.client.inference import ClientConfig, SwarmClient
    from hivekeeper.core.swarm.directory import (HelpPlanner, directory_report, live_peers_of, peers_here,
                                                 read_directory)

    client = SwarmClient(ClientConfig(_peers(args.initial_peers), "_directory", 1))
    try:
        rows = client.run(read_directory(client.dht), timeout=60)
        here = client.run(peers_here(client, live_peers_of(rows)), timeout=60)  # this machine's own servers
    finally:
        client.close()
    report = directory_report(rows, HelpPlanner(), here)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_models(report)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.swarm_command == "models":
        return run_models(args)
    if args.swarm_command != "status":
        raise InputError("usage: hivekeeper swarm status --model ID|PATH [--initial-peers MADDR ...] [--json], "
                         "or hivekeeper swarm models [--initial-peers MADDR ...] [--json]")
    from hivekeeper.core.runtime.checkpoint import load_config, resolve_checkpoint
    from hivekeeper.core.swarm.client.inference import ClientConfig, SwarmClient
    from hivekeeper.core.swarm.dht import dht_prefix_for
    from hivekeeper.core.swarm.status import other_models, read_swarm_status

    config = load_config(resolve_checkpoint(args.model, blocks=(0, 0), embeddings=False))
    prefix = dht_prefix_for(args.model, args.dht_prefix)
    client = SwarmClient(ClientConfig(_peers(args.initial_peers), prefix, config.num_layers))
    try:
        report = client.run(read_swarm_status(client, prefix))
        if not report["servers"]:  # nothing under this prefix: the models the swarm does list, if any
            report["other_models"] = client.run(other_models(client.dht, prefix))
    finally:
        client.close()
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_tables(report)
        if report.get("other_models"):
            print(other_models_line(report))
    return 0
