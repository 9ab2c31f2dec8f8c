"""Issue 16 item 4, the planning side, through the real command: `hivekeeper serve` on the real default model
(SmolLM2-135M-Instruct, Q4_1) with a RAM budget that holds its span packed but not in fp32 plans the span packed,
says so ("Serving 16 blocks, q4_1 packed", in fp32 under --dtype auto because the blocks stay packed), and the server
then loads exactly that many blocks, holding the bytes the planner counted (its "online" event's packed and fp32
bytes), within 80% of the budget with the KV cache.

One child process (the server runs until stopped; SIGTERM makes it announce OFFLINE and stop its p2pd).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from hivekeeper.core.child_argv import hivekeeper_command
from hivekeeper.core.runtime.default_model import DEFAULT_MODEL_ID, default_model_file
from hivekeeper.planner.gguf_metadata import gguf_sizes
from hivekeeper.planner.model_catalog import load_model_spec

from ...child_output import ChildOutput

pytestmark = pytest.mark.slow

BUDGET_GIB = 0.05  # --max-ram-gib: 53.7 MB, of which the span and its cache may take 80%
CACHE_TOKENS = 256


def test_serve_plans_a_gguf_span_packed_and_loads_what_it_planned_within_the_budget():
    path = default_model_file()
    spec, sizes = load_model_spec(str(path)), gguf_sizes(path)
    block = max(sizes.packed_block_bytes)
    cache = CACHE_TOKENS * 2 * spec.kv_dim * 4  # fp32 K and V per block
    budget = 0.8 * BUDGET_GIB * 2**30
    expected, fp32 = int(budget // (block + cache)), int(budget // (4 * spec.block_params() + cache))
    assert fp32 < expected < spec.num_layers  # only the packed span fits: fp32 would serve fewer blocks

    child = ChildOutput(subprocess.Popen(
        hivekeeper_command("serve", "--model", DEFAULT_MODEL_ID, "--new-swarm", "--host", "127.0.0.1",
                           "--max-ram-gib", str(BUDGET_GIB), "--cache-tokens", str(CACHE_TOKENS),
                           "--throughput", "1", "--json-status", "--stats-period", "0"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ)))
    try:
        said = child.wait_for(r"Serving (\d+) blocks, (\S+ packed) \(.*--dtype auto: (\w+), the GGUF's (\S+) blocks "
                              r"stay packed", timeout=120, stream="stderr")
        assert said.groups() == (str(expected), "q4_1 packed", "fp32", "q4_1")  # auto: fp32, the packed kernels'
        online = json.loads(child.wait_for(r'\{[^\n]*"state": "online"[^\n]*\}', timeout=180).group(0))
        start, end = online["blocks"]
        assert end - start == expected
        held = online["weights"]["bytes"]  # what the loaded span holds: q4_1 linears, fp32 norms
        assert set(held) == {"q4_1", "float32"} and sum(held.values()) == expected * block
        assert (end - start) * (block + cache) <= budget < (end - start + 1) * (block + cache)
        child.proc.send_signal(signal.SIGTERM)  # a clean stop: OFFLINE announced, its p2pd stopped
        assert child.wait(60) == 0
    finally:
        child.close()
