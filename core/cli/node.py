"""`hivekeeper node stats`: what this machine's node has given the swarm, today and in total.

Reads the contribution file that `hivekeeper serve` keeps (core/swarm/contribution.py): requests and tokens
served, time serving and energy used (from the plan's power figure, or the GPUs' own counters on NVIDIA). It reads
the file only: no network, no model.
"""

from __future__ import annotations

import argparse
import json

from hivekeeper.planner.errors import InputError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="node_command", metavar="SUBCOMMAND")
    stats = sub.add_parser("stats", help="requests and tokens served, uptime and energy: today and in total")
    stats.add_argument("--file", help="the contribution file (default: contribution.json in the data folder)")
    stats.add_argument("--json", action="store_true", help="print one JSON object")


def stats_lines(summary: dict) -> list[str]:
    """The summary as a small table: one row per period."""
    from hivekeeper.core.swarm.contribution import fmt_duration, fmt_energy

    lines = [f"{'':<7} {'requests':>10} {'tokens':>12} {'uptime':>14} {'energy':>10}"]
    for period in ("today", "total"):
        row = summary[period]
        lines.append(f"{period:<7} {int(row['requests']):>10,} {int(row['tokens']):>12,} "
                     f"{fmt_duration(row['uptime_s']):>14} {fmt_energy(row['energy_wh']):>10}")
    return lines


def run(args: argparse.Namespace) -> int:
    if args.node_command != "stats":
        raise InputError("usage: hivekeeper node stats [--json] [--file FILE]")
    from hivekeeper.core.swarm.contribution import contribution_path, contribution_summary, read_contribution

    path = args.file or contribution_path()
    summary = contribution_summary(read_contribution(path))
    if args.json:
        print(json.dumps({"file": str(path), **summary}))
    else:
        print(f"This machine's contribution to the swarm ({path}):")
        print("\n".join(stats_lines(summary)))
    return 0
