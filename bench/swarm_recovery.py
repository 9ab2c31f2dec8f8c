"""From a dead server to the next token: a 64-token greedy generation through a loopback swarm, with the server
of blocks 2:4 taken down at token 20 while another server also holds 2:4.

Two failures, each in a fresh generation:
- crash: SIGKILL to the server and its p2pd (a machine that dies; its DHT records stay until they expire);
- freeze: SIGSTOP to the server and its p2pd (a machine that hangs or drops off the network: no connection reset,
  only silence; the client's liveness probe finds it).
For each: seconds from the signal to the next token, the client's re-route + replay time, and whether the tokens
equal those of an undisturbed generation. Goal: <= 3 s. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from pathlib import Path

import torch

from hivekeeper.core.runtime.demo_model import make_demo_checkpoint
from hivekeeper.core.swarm.client.inference import SwarmModel
from hivekeeper.core.swarm.local import LocalSwarm

LAYERS, NEW_TOKENS, FAIL_AT = 6, 64, 20
PROMPT = torch.tensor([[1, 17, 42, 99, 7]])


def generation_with_failure(model, swarm, reference, how: str) -> dict:
    by_peer = {server.peer_id: server for server in swarm.servers}
    mark = {}

    def on_token(step, ids):
        if step == FAIL_AT:
            victim = next(peer for peer, start, end in session.route if (start, end) == (2, 4))
            server = by_peer[victim]
            mark["server"] = server
            mark["at"] = time.perf_counter()
            if how == "crash":
                server.kill()
            else:
                os.killpg(server.popen.pid, signal.SIGSTOP)
        elif "at" in mark and "next" not in mark:
            mark["next"] = time.perf_counter() - mark["at"]

    with model.inference_session(max_length=PROMPT.shape[1] + NEW_TOKENS) as session:
        tokens = model.generate(PROMPT, NEW_TOKENS, session=session, on_token=on_token)
        recoveries = session.recoveries
    if how == "freeze":
        os.killpg(mark["server"].popen.pid, signal.SIGCONT)
        mark["server"].kill()
    return {
        "kill_to_next_token_s": round(mark["next"], 3),
        "reroute_replay_s": round(recoveries[0]["seconds"], 3) if recoveries else None,
        "identical_tokens": bool(torch.equal(tokens, reference)),
    }


def main() -> None:
    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_demo_checkpoint(Path(tmp) / "recovery-demo", layers=LAYERS)
        with LocalSwarm(checkpoint, extra_args=("--torch-threads", "1", "--balance-period", "0"),
                        env={"XDG_CACHE_HOME": str(Path(tmp) / "cache")}) as swarm:
            for _ in range(3):
                swarm.start("--num-blocks", "2", wait="joining")
            swarm.start("--block-indices", "2:4", wait=None)
            for server in swarm.servers:
                server.wait_for("online")
            with SwarmModel(str(checkpoint), initial_peers=swarm.initial_peers) as model:
                reference = model.generate(PROMPT, NEW_TOKENS)
                results["crash"] = generation_with_failure(model, swarm, reference, "crash")
                swarm.start("--block-indices", "2:4")  # a new spare for the second failure
                model.client.run(model.client.view(refresh=True))  # see the new spare
                results["freeze"] = generation_with_failure(model, swarm, reference, "freeze")
    print(json.dumps({"bench": "swarm_recovery", "new_tokens": NEW_TOKENS, "failure_at_token": FAIL_AT,
                      **results, "goal_s": 3.0}))


if __name__ == "__main__":
    main()
