"""Training tokens/s of deep prompts: blocks run here, and through a 2-server loopback swarm (issue 21).

A demo checkpoint (8 blocks, hidden 512) trains 8 deep prompt tokens on batches of 4 sequences of 64 tokens: one
warm-up step, then STEPS timed steps, first with the blocks here (`LocalBlocks`), then with two `hivekeeper serve`
processes on 127.0.0.1 holding blocks 0:4 and 4:8 (one torch thread each, as the local run) and the blocks' work sent over
rpc_forward / rpc_backward (`SwarmBlocks`). Tokens counted are those through the blocks (prompts included).

"waiting_share": the swarm step's time spent waiting on the servers (their compute and the transfers).
"network_share": the share of the swarm step that the local run does not spend, (swarm - local) / swarm: the cost
of serialization, loopback transfers and hops, since the same blocks compute either way (an estimate: the servers'
single threads and the local run's threads differ). Prints one JSON line, with the load average.
"""

from __future__ import annotations

import hivekeeper.core  # noqa: F401 - first, before numpy and torch: sets OpenBLAS's idle-thread timeout

import json
import os
import tempfile
import time

import torch

from _common import demo_checkpoint, fixed_prompt

from hivekeeper.core.finetune.blocks import local_blocks, swarm_blocks
from hivekeeper.core.finetune.data import Example
from hivekeeper.core.finetune.prompts import PromptsInfo, TrainablePrompts
from hivekeeper.core.finetune.trainer import TrainConfig, Trainer, load_frozen_parts
from hivekeeper.core.swarm.local import LocalSwarm

SHAPE = dict(layers=8, hidden=512, intermediate=1408, heads=8, kv_heads=4, vocab=8000, max_position=2048)
BATCH, TOKENS, PROMPT_TOKENS, STEPS = 4, 64, 8, 5


def examples() -> list[Example]:
    ids = fixed_prompt(SHAPE["vocab"], TOKENS)
    return [Example(tuple(ids[i:] + ids[:i]), TOKENS // 2, i + 1) for i in range(BATCH * 2)]


def tokens_per_s(parts, blocks) -> tuple[float, float]:
    """(training tokens/s over STEPS steps after a warm-up step, seconds per step)."""
    prompts = TrainablePrompts("deep_ptune", PROMPT_TOKENS, SHAPE["hidden"], SHAPE["layers"])
    prompts.start_from_vocabulary(parts.embedding.weight)
    info = PromptsInfo("bench", "deep_ptune", PROMPT_TOKENS, SHAPE["hidden"], SHAPE["layers"])
    trainer = Trainer(parts, blocks, prompts, info, examples(), TrainConfig(steps=STEPS + 1, batch=BATCH))
    trainer.step()
    if hasattr(blocks, "network_s"):
        blocks.network_s = 0.0  # count the timed steps only
    started = time.perf_counter()
    tokens = sum(trainer.step().tokens for _ in range(STEPS))
    seconds = time.perf_counter() - started
    return tokens / seconds, seconds / STEPS


def main() -> None:
    torch.set_num_threads(1)  # as each server (--torch-threads 1): the same compute on either side
    checkpoint = demo_checkpoint("finetune-bench", SHAPE)
    parts = load_frozen_parts(checkpoint)
    local_tps, local_step = tokens_per_s(parts, local_blocks(checkpoint))
    with tempfile.TemporaryDirectory() as logs, \
            LocalSwarm(checkpoint, extra_args=("--torch-threads", "1", "--throughput", "1"), log_dir=logs) as swarm:
        swarm.start("--block-indices", "0:4", timeout=180)
        swarm.start("--block-indices", "4:8", timeout=180)
        blocks = swarm_blocks(str(checkpoint), SHAPE["layers"], swarm.initial_peers)
        try:
            swarm_tps, swarm_step = tokens_per_s(parts, blocks)
            waiting = blocks.network_s / STEPS
        finally:
            blocks.client.close()
    print(json.dumps({
        "benchmark": "finetune", "shape": SHAPE, "batch": BATCH, "tokens": TOKENS, "prompt_tokens": PROMPT_TOKENS,
        "steps": STEPS, "torch_threads": 1,
        "local_tokens_per_s": round(local_tps, 1), "swarm_tokens_per_s": round(swarm_tps, 1),
        "local_step_s": round(local_step, 3), "swarm_step_s": round(swarm_step, 3),
        "waiting_share": round(waiting / swarm_step, 3),
        "network_share": round(max(0.0, swarm_step - local_step) / swarm_step, 3),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }))


if __name__ == "__main__":
    main()
