"""A legitimate client's first-token time on a loopback server, alone and while 20 abusive peers flood it.

Starts one `hivekeeper serve` process (all 4 blocks of a demo model, one torch thread) and measures, ROUNDS times,
how long a legitimate client (SwarmModel) takes to open an inference session and get its first step (a 16-token
prompt) back: first with no one else, then while ABUSERS separate hivemind peers each send 4 MiB forwards
(rpc_forward_stream, [16, 1024, 64]: the most rows max_forward_tokens allows) as fast as they are answered
or refused. Issue 17 measured 20 s of delay from such a flood before the server had quotas and priorities.

Reports the medians, the abusers' forwards answered and refused ("server busy"), the server's peak RSS, and the load
average. Prints one JSON line.
"""

from __future__ import annotations

import hivekeeper.core  # noqa: F401 - first, before numpy and torch: sets OpenBLAS's idle-thread timeout

import asyncio
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from hivekeeper.core.runtime.demo_model import make_demo_checkpoint
from hivekeeper.core.swarm.client.inference import SwarmModel
from hivekeeper.core.swarm.local import LocalSwarm
from hivekeeper.core.swarm.protocol import chain_uid, handler_name, is_busy, new_event_loop, pack_args, \
    pack_metadata, serialize_tensor, stream_messages

LAYERS, ABUSERS, ROUNDS, PROMPT_TOKENS = 4, 20, 5, 16
FLOOD_SHAPE = (16, 1024, 64)  # one abusive forward: 16384 rows, the server's max_forward_tokens, within the context


class Flood:
    """ABUSERS hivemind peers on their own event loop thread, each sending forwards back to back until stopped."""

    def __init__(self, maddrs: list[str], peer_id: str, prefix: str):
        self.maddrs, self.server = maddrs, PeerID.from_base58(peer_id)
        hidden = torch.randn(*FLOOD_SHAPE)
        flat, structure = pack_args(hidden, torch.empty(0))
        self.tensors = [serialize_tensor(t) for t in flat]
        self.metadata = pack_metadata({"args_structure": structure})
        self.uid = chain_uid(prefix, 0, LAYERS)
        self.answered = self.refused = self.failed = 0
        self.first_failure = ""
        self.loop = new_event_loop()
        self.stopping = asyncio.Event()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._run(),), daemon=True)
        self.started = threading.Event()

    def __enter__(self) -> "Flood":
        self.thread.start()
        self.started.wait(120)
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.stopping.set)
        self.thread.join(60)

    async def _run(self) -> None:
        peers = [await P2P.create(initial_peers=self.maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
                 for _ in range(ABUSERS)]
        self.started.set()
        try:
            await asyncio.gather(*(self._abuse(peer) for peer in peers))
        finally:
            await asyncio.gather(*(peer.shutdown() for peer in peers), return_exceptions=True)

    async def _abuse(self, peer: P2P) -> None:
        while not self.stopping.is_set():
            try:
                async def requests():
                    for message in stream_messages(self.tensors, lambda **kw: runtime_pb2.ExpertRequest(
                            uid=self.uid, **kw), self.metadata):
                        yield message

                responses = await peer.iterate_protobuf_handler(self.server, handler_name("rpc_forward_stream"),
                                                                requests(), runtime_pb2.ExpertResponse)
                async for _ in responses:
                    pass
                self.answered += 1
            except Exception as exc:
                if is_busy(exc):
                    self.refused += 1
                else:
                    self.failed += 1
                    self.first_failure = self.first_failure or str(exc)[-200:]
                await asyncio.sleep(0.01)  # an abuser this eager still leaves the bench process some CPU


def first_token_seconds(model: SwarmModel, prompt: torch.Tensor) -> float:
    started = time.perf_counter()
    with model.inference_session(max_length=PROMPT_TOKENS + 1) as session:
        session.step(prompt)
        return time.perf_counter() - started


def rounds(model: SwarmModel, prompt: torch.Tensor, server: psutil.Process, peak: list[int],
           failures: list[str]) -> list[float]:
    """First-token times of ROUNDS sessions; a session that fails counts with the time it took to fail."""
    times = []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        try:
            times.append(first_token_seconds(model, prompt))
        except Exception as exc:  # the client gave up (a swarm gap): reported, not fatal to the bench
            times.append(time.perf_counter() - started)
            failures.append(str(exc)[-200:])
        peak[0] = max(peak[0], server.memory_info().rss)
        time.sleep(0.5)
    return times


def main() -> None:
    torch.set_num_threads(1)
    prompt = torch.randn(1, PROMPT_TOKENS, 64)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_demo_checkpoint(Path(tmp) / "abuse-demo", layers=LAYERS)
        with LocalSwarm(checkpoint, extra_args=("--torch-threads", "1", "--balance-period", "0"),
                        env={"XDG_CACHE_HOME": str(Path(tmp) / "cache")}) as swarm:
            server = swarm.start("--num-blocks", str(LAYERS))
            process = psutil.Process(server.popen.pid)
            with SwarmModel(str(checkpoint), initial_peers=swarm.initial_peers) as model:
                first_token_seconds(model, prompt)  # warm-up: routing, the first session
                quiet_peak, flood_peak = [process.memory_info().rss], [0]
                failures: list[str] = []
                quiet = rounds(model, prompt, process, quiet_peak, failures)
                with Flood(server.maddrs, server.peer_id, model.client.config.dht_prefix) as flood:
                    time.sleep(3)  # let the flood fill the server's queue
                    quiet_failures, failures = len(failures), []
                    flooded = rounds(model, prompt, process, flood_peak, failures)
    print(json.dumps({
        "bench": "swarm_abuse",
        "abusers": ABUSERS,
        "flood_request_mib": torch.Size(FLOOD_SHAPE).numel() * 4 / 2**20,
        "rounds": ROUNDS,
        "first_token_s_alone": round(statistics.median(quiet), 3),
        "first_token_s_flooded": round(statistics.median(flooded), 3),
        "first_token_s_flooded_max": round(max(flooded), 3),
        "legit_failures_alone": quiet_failures,
        "legit_failures_flooded": len(failures),
        "legit_first_failure": failures[0] if failures else "",
        "flood_answered": flood.answered,
        "flood_refused_busy": flood.refused,
        "flood_failed_otherwise": flood.failed,
        "flood_first_failure": flood.first_failure,
        "server_rss_mb_alone": round(quiet_peak[0] / 2**20),
        "server_rss_mb_flooded": round(flood_peak[0] / 2**20),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }))


if __name__ == "__main__":
    main()
