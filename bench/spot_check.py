"""What spot checks cost: a 64-token greedy generation through a loopback swarm of a 6-block demo model (servers of
blocks 0:3 and 3:6, each with a spare), with spot checks off, at the default rate with a local referee (the client
has the weights), and at the default rate with remote referees (the spares recompute).

    python bench/spot_check.py [--tokens 64] [--rate 0.125] [--repeats 3]

Goal: at the default rate (every 8th step), under 25% more time per generated token with either referee; tokens
identical to the run without checks. Prints one JSON line with each setting's median tokens/s over the repeats, the
overhead against the run without checks, the checks made, and the load average before and after (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hivekeeper.core.runtime.demo_model import make_demo_checkpoint
from hivekeeper.core.swarm.client.inference import SwarmModel
from hivekeeper.core.swarm.client.spot_check import SpotCheckConfig
from hivekeeper.core.swarm.local import LocalSwarm

LAYERS = 6
PROMPT = torch.tensor([[1, 17, 42, 99, 7]])


def run(checkpoint: Path, peers: list[str], tokens: int, repeats: int, **options) -> dict:
    """`repeats` generations with one client: the median tokens/s, the checks made, the tokens of the last."""
    rates, checks = [], []
    with SwarmModel(str(checkpoint), initial_peers=peers, **options) as model:
        model.generate(PROMPT, 4)  # warm-up: routes, RTTs, the local referee's weights
        for _ in range(repeats):
            model.client.spot_check_log.clear()
            started = time.perf_counter()
            ids = model.generate(PROMPT, tokens)
            rates.append(tokens / (time.perf_counter() - started))
            checks.extend(model.client.spot_check_log)
    return {"tokens_per_s": round(statistics.median(rates), 2), "runs_tokens_per_s": [round(r, 2) for r in rates],
            "checks": len(checks), "mismatches": sum(1 for c in checks if c["ok"] is False), "ids": ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rate", type=float, default=SpotCheckConfig().rate)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_demo_checkpoint(Path(tmp) / "spot-check-demo", layers=LAYERS)
        common = ("--torch-threads", "1", "--balance-period", "0", "--throughput", "10")
        with LocalSwarm(checkpoint, extra_args=common, env={"XDG_CACHE_HOME": str(Path(tmp) / "cache")}) as swarm:
            for span in ("0:3", "3:6", "0:3", "3:6"):
                swarm.start("--block-indices", span)
            peers = swarm.initial_peers
            off = run(checkpoint, peers, args.tokens, args.repeats, spot_check_rate=0.0)
            local = run(checkpoint, peers, args.tokens, args.repeats, spot_check_rate=args.rate)
            remote = run(checkpoint, peers, args.tokens, args.repeats, spot_check_rate=args.rate,
                         spot_check_local_blocks=0)
    runs = {"off": off, "local_referee": local, "remote_referee": remote}
    report = {"bench": "spot_check", "rate": args.rate, "new_tokens": args.tokens, "layers": LAYERS}
    ids = {name: result.pop("ids") for name, result in runs.items()}
    for name, result in runs.items():
        if name != "off":
            result["identical_tokens"] = bool(torch.equal(ids[name], ids["off"]))
            result["overhead"] = round(off["tokens_per_s"] / result["tokens_per_s"] - 1, 3)
        report[name] = result
    report.update(goal_overhead=0.25, load_before=[round(x, 2) for x in load_before],
                  load_after=[round(x, 2) for x in os.getloadavg()])
    print(json.dumps(report))


if __name__ == "__main__":
    main()
