"""Per-hop overhead of the swarm: a 1-token inference step through 3 loopback servers vs the same blocks locally.

Starts three `hivekeeper serve` processes on 127.0.0.1 (2 blocks each of a 6-block demo model, one torch thread
each) and opens one inference session through all of them. Then, STEPS times in turn, times one 1-token step
through the swarm and one step of the same 6 blocks run in this process with a local KV cache: alternating puts
both under the same load (this VM's speed drifts by up to 2x within minutes, so timing them minutes apart measured
the drift). overhead_per_hop_ms = (median swarm step - median local step) / 3. Goal: <= 3 ms per hop on loopback.
Prints one JSON line, with the load average.
"""

from __future__ import annotations

import hivekeeper.core  # noqa: F401 - first, before numpy and torch: sets OpenBLAS's idle-thread timeout

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hivekeeper.core.runtime.checkpoint import load_span
from hivekeeper.core.runtime.demo_model import make_demo_checkpoint
from hivekeeper.core.runtime.model import KVCache
from hivekeeper.core.swarm.client.inference import SwarmModel
from hivekeeper.core.swarm.local import LocalSwarm

LAYERS, SERVERS, STEPS, WARMUP = 6, 3, 300, 20


def seconds(step) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


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
            span = load_span(checkpoint, 0, LAYERS)
            cache = KVCache.allocate(span.config, LAYERS, 1, WARMUP + STEPS + 1)
            with SwarmModel(str(checkpoint), initial_peers=swarm.initial_peers) as model:
                with model.inference_session(max_length=WARMUP + STEPS + 1) as session, torch.inference_mode():
                    for _ in range(WARMUP):
                        session.step(x)
                        span(x, cache)
                    hops = len(session.route)
                    swarm_times, local_times = [], []
                    for _ in range(STEPS):
                        swarm_times.append(seconds(lambda: session.step(x)))
                        local_times.append(seconds(lambda: span(x, cache)))
    swarm_ms, local_ms = (statistics.median(times) * 1e3 for times in (swarm_times, local_times))
    print(json.dumps({
        "bench": "swarm_hop",
        "hops": hops,
        "blocks": LAYERS,
        "steps": STEPS,
        "swarm_step_ms": round(swarm_ms, 3),
        "local_step_ms": round(local_ms, 3),
        "overhead_per_hop_ms": round((swarm_ms - local_ms) / hops, 3),
        "goal_ms": 3.0,
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }))


if __name__ == "__main__":
    main()
