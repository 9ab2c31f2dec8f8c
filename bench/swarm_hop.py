"""Per-hop overhead of the swarm: a 1-token inference step through 3 loopback servers vs the same blocks locally.

Starts three `hivekeeper serve` processes on 127.0.0.1 (2 blocks each of a 6-block demo model, one torch thread
each), opens one inference session through all of them and times 1-token steps; then times the same 6 blocks run
in this process with a local KV cache. overhead_per_hop_ms = (swarm step - local step) / 3. Medians of STEPS steps.
Goal: <= 3 ms per hop on loopback. Prints one JSON line.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hivekeeper.core.checkpoint import load_span
from hivekeeper.core.demo_model import make_demo_checkpoint
from hivekeeper.core.model import KVCache
from hivekeeper.core.swarm_client import SwarmModel
from hivekeeper.core.swarm_local import LocalSwarm

LAYERS, SERVERS, STEPS, WARMUP = 6, 3, 300, 20


def median_ms(step, count: int) -> float:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_demo_checkpoint(Path(tmp) / "hop-demo", layers=LAYERS)
        x = torch.randn(1, 1, 64)
        with LocalSwarm(checkpoint, extra_args=("--torch-threads", "1", "--balance-period", "0"),
                        env={"XDG_CACHE_HOME": str(Path(tmp) / "cache")}) as swarm:
            for _ in range(SERVERS):
                swarm.start("--num-blocks", str(LAYERS // SERVERS), wait="joining")
            for server in swarm.servers:
                server.wait_for("online")
            with SwarmModel(str(checkpoint), initial_peers=swarm.initial_peers) as model:
                with model.inference_session(max_length=WARMUP + STEPS + 1) as session:
                    for _ in range(WARMUP):
                        session.step(x)
                    hops = len(session.route)
                    swarm_ms = median_ms(lambda: session.step(x), STEPS)
        span = load_span(checkpoint, 0, LAYERS)
        cache = KVCache.allocate(span.config, LAYERS, 1, WARMUP + STEPS + 1)
        with torch.inference_mode():
            for _ in range(WARMUP):
                span(x, cache)
            local_ms = median_ms(lambda: span(x, cache), STEPS)
    print(json.dumps({
        "bench": "swarm_hop",
        "hops": hops,
        "blocks": LAYERS,
        "steps": STEPS,
        "swarm_step_ms": round(swarm_ms, 3),
        "local_step_ms": round(local_ms, 3),
        "overhead_per_hop_ms": round((swarm_ms - local_ms) / hops, 3),
        "goal_ms": 3.0,
    }))


if __name__ == "__main__":
    main()
