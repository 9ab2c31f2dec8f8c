"""The real default model in a loopback swarm: two `hivekeeper serve` processes split SmolLM2-135M-Instruct's 30
blocks (each reads only its span from the GGUF), and `hivekeeper generate --swarm` gives the same greedy text as
`hivekeeper generate` run locally."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hivekeeper.core.runtime.default_model import DEFAULT_MODEL_ID, INSTALL_HINT, default_model_file
from hivekeeper.core.swarm.local import LocalSwarm

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(default_model_file() is None,
                                 reason=f"the default model is not installed ({INSTALL_HINT})")]

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
PROMPT = "The three primary colors are"
NEW_TOKENS = 24


def generate(*args: str, timeout: float = 240.0) -> dict:
    """`hivekeeper generate --json` of the default model as a subprocess (killed at the deadline, the test failing
    with what it printed so far): its report."""
    command = [sys.executable, "-m", "hivekeeper.core.cli.main", "generate", "--model", DEFAULT_MODEL_ID,
               "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos", "--json", *args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=timeout)
    except subprocess.TimeoutExpired as exc:  # subprocess.run has killed the child
        pytest.fail(f"generate {' '.join(args)} did not finish in {timeout:g} s:\n{exc.stdout}\n{exc.stderr}")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_two_servers_split_the_real_model_and_generate_like_local(tmp_path):
    with LocalSwarm(DEFAULT_MODEL_ID, extra_args=("--torch-threads", "1", "--throughput", "1"),
                    log_dir=tmp_path) as swarm:
        first = swarm.start("--block-indices", "0:15", timeout=120)
        second = swarm.start("--block-indices", "15:30", timeout=120)
        assert (first.blocks, second.blocks) == ((0, 15), (15, 30))
        remote = generate("--swarm", "--initial-peers", *swarm.initial_peers)
    local = generate()
    assert remote["new_tokens"] == local["new_tokens"] == NEW_TOKENS
    assert remote["text"] == local["text"], (remote["text"], local["text"])
    assert remote["plan"]["source"] == "swarm" and not remote["random_weights"]
