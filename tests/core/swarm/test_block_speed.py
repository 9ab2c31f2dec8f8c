"""What `serve` advertises is timed on a block as the server holds it (core/swarm/server/throughput.py).

The real default model is a Q4_1 GGUF that a CPU server keeps packed: the block timed is its first block loaded
packed, and the cache keeps the timing under the served format (before, every span was timed as a random fp32
block, 1.5-2x off the packed span's forward on this machine, and the app's page could not find it). A timing taken
while the machine was busy (load above the CPU count) is used but says so."""

from __future__ import annotations

import dataclasses
import json

import torch

from hivekeeper.core.runtime.checkpoint import load_config
from hivekeeper.core.runtime.default_model import resolve_default_model
from hivekeeper.core.runtime.kernels.quant_kernels import QuantizedLinear
from hivekeeper.core.swarm.server.throughput import (cache_key, cache_path, cached_block_speed, get_block_speed,
                                                     served_format, served_span)


def test_the_served_block_is_timed_and_kept_under_its_format(tmp_path, monkeypatch):
    monkeypatch.setenv("HIVEKEEPER_DATA_DIR", str(tmp_path))  # no block timed here yet
    path = resolve_default_model()
    config = load_config(path)
    assert served_format(path, "cpu", torch.float32, "none") == "q4_1 packed"
    assert served_format(None, "cpu", torch.float32, "none") == "fp32"  # a hub model's weights are not here yet
    assert served_format(path, "cpu", torch.float32, "nf4") == "nf4"
    span = served_span(path, config, torch.device("cpu"), torch.float32, "none")
    assert len(span.blocks) == 1 and isinstance(span.blocks[0].mlp.down_proj, QuantizedLinear)  # packed, as served

    said = []
    speed, cached = get_block_speed(config, "cpu", torch.float32, checkpoint=path, log=said.append)
    assert not cached and speed.forward_rps > 0 and speed.inference_rps > 0 and "(q4_1 packed)" in said[0]
    assert cached_block_speed(config, "cpu", "q4_1 packed") == speed  # what the app's Swarm page reads
    assert cached_block_speed(config, "cpu", "fp32") is None  # an fp32 span is another figure
    assert speed.cpus >= 1 and speed.loadavg >= 0 and speed.source_words().startswith("measured by `serve` on ")
    busy = dataclasses.replace(speed, loadavg=speed.cpus + 1.5)  # serve's online line says a busy timing is one
    assert busy.source_words(now=True) == f"measured now (load {speed.cpus + 1.5:.1f}, busy: {speed.cpus} CPUs)"

    # a busy timing (as one at load 99 would be recorded) is used as it is, so that servers of one machine advertise
    # alike, and said: the online line's source words, and how to measure again
    data = json.loads(cache_path().read_text())
    data[cache_key(config, "cpu", "q4_1 packed")]["loadavg"] = 99.0
    cache_path().write_text(json.dumps(data))
    again, cached = get_block_speed(config, "cpu", torch.float32, checkpoint=path, log=said.append)
    assert cached and again.busy and "(load 99.0, busy: " in again.source_words()
    assert "`--throughput eval` measures again" in said[1]
    fresh, cached = get_block_speed(config, "cpu", torch.float32, checkpoint=path, force_measure=True)
    assert not cached and cached_block_speed(config, "cpu", "q4_1 packed") == fresh
