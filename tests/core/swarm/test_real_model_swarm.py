"""The real default model in a loopback swarm: two `hivekeeper serve` processes split SmolLM2-135M-Instruct's 30
blocks (each reads only its span from the GGUF, and serves it packed: the file's Q4_1/Q8_0 block bytes, hidden
states in fp32), and `hivekeeper generate --swarm` gives the same greedy text as `hivekeeper generate` run locally.
The local run and the two servers start side by side."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hivekeeper.core.runtime.default_model import DEFAULT_MODEL_ID, INSTALL_HINT, default_model_file
from hivekeeper.core.swarm.local import LocalSwarm

from ...child_output import ChildOutput

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(default_model_file() is None,
                                 reason=f"the default model is not installed ({INSTALL_HINT})")]

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
PROMPT = "The three primary colors are"
NEW_TOKENS = 12  # greedy text equal token for token; a longer text only costs swarm round trips


def generate(*args: str) -> ChildOutput:
    """`hivekeeper generate --json` of the default model, started as a subprocess (read with `report_of`)."""
    command = [sys.executable, "-m", "hivekeeper.core.cli.main", "generate", "--model", DEFAULT_MODEL_ID,
               "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos", "--json", *args]
    return ChildOutput(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV))


def report_of(command: ChildOutput, timeout: float = 240.0) -> dict:
    """A generate's report once it has ended (killed at the deadline, the test failing with what it printed)."""
    try:
        code = command.wait(timeout)
    finally:
        command.close()
    assert code == 0, command.stderr
    return json.loads(command.stdout)


def check_packed(online: dict, layers: range) -> None:
    """Issue 16 item 4: a server's span holds the GGUF's linears packed (bytes per format in its "online" event: the
    packed size, a fraction of fp32) and sends hidden states in fp32."""
    from hivekeeper.core.runtime.gguf import GGUFCheckpoint
    from hivekeeper.planner.gguf_metadata import gguf_sizes

    checkpoint = GGUFCheckpoint(default_model_file())
    held = online["weights"]["bytes"]
    assert online["weights"]["hidden_dtype"] == "float32"
    assert held.get("q4_1", 0) > 0 and set(held) <= {"q4_1", "q8_0", "float32"}  # SmolLM2's file: Q4_1 and Q8_0
    packed = sum(gguf_sizes(checkpoint.path).packed_block_bytes[layer] for layer in layers)
    assert sum(held.values()) == pytest.approx(packed, rel=0.01)
    assert sum(held.values()) < 4 * checkpoint.config.block_param_count() * len(layers) / 3


def test_two_servers_split_the_real_model_and_generate_like_local(tmp_path):
    reference = generate()  # runs while the servers start
    try:
        with LocalSwarm(DEFAULT_MODEL_ID, extra_args=("--torch-threads", "1", "--throughput", "1"),
                        log_dir=tmp_path) as swarm:
            first = swarm.start("--block-indices", "0:15", wait="started", timeout=120)
            second = swarm.start("--block-indices", "15:30", wait=None)  # loads beside the first
            online = [server.wait_for("online", timeout=120) for server in (first, second)]
            assert (first.blocks, second.blocks) == ((0, 15), (15, 30))
            check_packed(online[0], range(0, 15))
            check_packed(online[1], range(15, 30))
            remote = report_of(generate("--swarm", "--initial-peers", *swarm.initial_peers))
        local = report_of(reference)
    finally:
        reference.close()
    assert remote["new_tokens"] == local["new_tokens"] == NEW_TOKENS
    assert remote["text"] == local["text"], (remote["text"], local["text"])
    assert remote["plan"]["source"] == "swarm" and not remote["random_weights"]
